//! Unit and property tests of the membership state machines: an in-memory
//! cluster with simulated time, and properties of merge and codec.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::ids::{Address, MemberUid, UniqueAddress};

fn addr(i: usize) -> Address {
    Address(format!("127.0.0.{}:7101", i + 1).into())
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// A tiny in-memory cluster: messages take 10 ms, links can be cut.
struct Net {
    nodes: Vec<Option<ClusterNode>>,
    in_flight: Vec<(Duration, usize, ClusterMessage)>,
    cut: BTreeSet<(usize, usize)>,
    now: Duration,
    events: Vec<Vec<ClusterEvent>>,
    stops: BTreeMap<usize, StopReason>,
    singleton: BTreeSet<usize>,
    uid_seq: u64,
    /// Slots whose port refuses connections (the process is gone but the
    /// host answers): a message to them is refused back to its sender.
    refusing: BTreeSet<usize>,
    /// Directed links that refuse (a firewall answering with a reset).
    refusing_links: BTreeSet<(usize, usize)>,
    refusals: Vec<(Duration, usize, Address)>,
}

impl Net {
    fn new(n: usize, stable_after: Duration) -> Self {
        let mut net = Net {
            nodes: Vec::new(),
            in_flight: Vec::new(),
            cut: BTreeSet::new(),
            now: Duration::ZERO,
            events: vec![Vec::new(); n],
            stops: BTreeMap::new(),
            singleton: BTreeSet::new(),
            uid_seq: 0,
            refusing: BTreeSet::new(),
            refusing_links: BTreeSet::new(),
            refusals: Vec::new(),
        };
        for i in 0..n {
            let node = net.make(i, n, stable_after);
            net.nodes.push(Some(node));
        }
        net
    }

    fn make(&mut self, i: usize, n: usize, stable_after: Duration) -> ClusterNode {
        self.uid_seq += 1;
        let seeds = (0..n.min(3)).map(addr).collect();
        let mut cfg = ClusterConfig::new(addr(i), seeds);
        cfg.downing = DowningConfig::SplitBrainResolver(SbrConfig::with_stable_after(stable_after));
        let mut node = ClusterNode::new(cfg, MemberUid(1000 * self.uid_seq + i as u64), self.now);
        node.subscribe();
        node
    }

    fn index_of(&self, a: &Address) -> Option<usize> {
        (0..self.nodes.len()).find(|i| addr(*i) == *a)
    }

    fn drain(&mut self, i: usize) {
        let now = self.now;
        let Some(node) = self.nodes[i].as_mut() else {
            return;
        };
        if let Some(r) = node.poll_stop() {
            self.stops.insert(i, r);
            self.singleton.remove(&i);
        }
        while let Some(c) = node.poll_singleton() {
            match c {
                SingletonCommand::Start => {
                    self.singleton.insert(i);
                }
                SingletonCommand::Stop => {
                    self.singleton.remove(&i);
                    node.handle_singleton_stopped(now);
                }
            }
        }
        while let Some(e) = node.poll_event() {
            self.events[i].push(e);
        }
        let mut out = Vec::new();
        while let Some(t) = node.poll_transmit() {
            out.push(t);
        }
        assert!(node.poll_singleton().is_none());
        for t in out {
            if let Some(j) = self.index_of(&t.to) {
                let refused = (self.nodes[j].is_none() && self.refusing.contains(&j))
                    || self.refusing_links.contains(&(i, j));
                if refused {
                    self.refusals.push((now + ms(1), i, t.to.clone()));
                } else if !self.cut.contains(&(i, j)) {
                    // the bytes go through the codec, as on the wire
                    let bytes = encode(&t.message);
                    let msg = decode(&bytes).expect("round trip");
                    assert_eq!(msg, t.message);
                    self.in_flight.push((now + ms(10), j, msg));
                }
            }
        }
    }

    fn step_until(&mut self, until: Duration) {
        while self.now < until {
            let next_msg = self
                .in_flight
                .iter()
                .map(|m| m.0)
                .chain(self.refusals.iter().map(|r| r.0))
                .min();
            let next_timer = self
                .nodes
                .iter()
                .flatten()
                .filter_map(|n| n.poll_timeout())
                .min();
            let next = [next_msg, next_timer, Some(until)]
                .into_iter()
                .flatten()
                .min()
                .unwrap();
            self.now = next.max(self.now);
            let now = self.now;
            let (due, rest): (Vec<_>, Vec<_>) = self.in_flight.drain(..).partition(|m| m.0 <= now);
            self.in_flight = rest;
            let (refused, rest): (Vec<_>, Vec<_>) =
                self.refusals.drain(..).partition(|r| r.0 <= now);
            self.refusals = rest;
            for (_, i, a) in refused {
                if let Some(n) = self.nodes[i].as_mut() {
                    n.handle_connection_refused(now, &a);
                }
                self.drain(i);
            }
            for (_, j, msg) in due {
                if let Some(n) = self.nodes[j].as_mut() {
                    n.handle_message(now, msg);
                }
                self.drain(j);
            }
            for i in 0..self.nodes.len() {
                if let Some(n) = self.nodes[i].as_mut() {
                    if n.poll_timeout().is_some_and(|t| t <= now) {
                        n.handle_timeout(now);
                    }
                }
                self.drain(i);
            }
            assert!(
                self.singleton.len() <= 1,
                "two coordinators: {:?}",
                self.singleton
            );
        }
    }

    fn node(&self, i: usize) -> &ClusterNode {
        self.nodes[i].as_ref().unwrap()
    }

    fn statuses(&self, i: usize) -> Vec<(Address, MemberStatus)> {
        self.node(i)
            .gossip()
            .members
            .values()
            .map(|m| (m.unique_address.address.clone(), m.status))
            .collect()
    }

    fn partition(&mut self, a: &[usize], b: &[usize]) {
        for &x in a {
            for &y in b {
                self.cut.insert((x, y));
                self.cut.insert((y, x));
            }
        }
    }
}

fn all_up(net: &Net, live: &[usize]) -> bool {
    live.iter().all(|&i| {
        let st = net.statuses(i);
        st.len() == live.len() && st.iter().all(|(_, s)| *s == MemberStatus::Up)
    })
}

#[test]
fn three_nodes_join_through_seeds_and_converge() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    assert!(all_up(&net, &[0, 1, 2]), "{:?}", net.statuses(0));
    let leader = net.node(1).leader().unwrap();
    assert_eq!(leader.address, addr(0));
    for i in 0..3 {
        assert_eq!(net.node(i).oldest().unwrap().address, addr(0));
        assert!(net.node(i).is_available());
    }
    assert_eq!(net.singleton, BTreeSet::from([0]));
    // a subscriber's fold of the events equals the published state
    for i in 0..3 {
        let mut st = CurrentClusterState::default();
        assert!(matches!(
            net.events[i][0],
            ClusterEvent::CurrentClusterState(_)
        ));
        for e in &net.events[i] {
            st.apply(e);
        }
        assert_eq!(&st, net.node(i).current_state());
    }
}

#[test]
fn only_the_first_seed_forms_a_cluster_after_the_timeout() {
    // node 1 (second seed) alone never forms a cluster
    let mut net = Net::new(3, Duration::from_secs(5));
    net.nodes[0] = None;
    net.nodes[2] = None;
    net.step_until(Duration::from_secs(30));
    assert!(net.node(1).self_member().is_none());
    // the first seed alone forms one, but not before seed_node_timeout
    let mut net = Net::new(3, Duration::from_secs(5));
    net.nodes[1] = None;
    net.nodes[2] = None;
    net.step_until(ms(4_900));
    assert!(net.node(0).self_member().is_none());
    net.step_until(Duration::from_secs(8));
    assert_eq!(net.node(0).self_member().unwrap().status, MemberStatus::Up);
}

#[test]
fn crashed_member_is_downed_and_removed_by_keep_majority() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    assert!(all_up(&net, &[0, 1, 2]));
    net.nodes[2] = None; // crash
    net.step_until(Duration::from_secs(60));
    assert!(all_up(&net, &[0, 1]), "{:?}", net.statuses(0));
    assert!(net
        .node(0)
        .gossip()
        .tombstones
        .iter()
        .any(|t| t.address == addr(2)));
    assert!(net.events[0].iter().any(
        |e| matches!(e, ClusterEvent::UnreachableMember(m) if m.unique_address.address == addr(2))
    ));
    assert!(net.events[0].iter().any(|e| matches!(
        e,
        ClusterEvent::MemberRemoved {
            previous_status: MemberStatus::Down,
            ..
        }
    )));
    // It never answered again: no survivor reports it reachable, before or
    // after it was downed.
    for i in [0, 1] {
        assert!(
            !net.events[i].iter().any(|e| matches!(
                e,
                ClusterEvent::ReachableMember(m) if m.unique_address.address == addr(2)
            )),
            "node {i}: {:?}",
            net.events[i]
        );
    }
}

#[test]
fn oldest_crash_moves_the_singleton_after_removal() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    assert_eq!(net.singleton, BTreeSet::from([0]));
    net.nodes[0] = None;
    net.singleton.clear();
    net.step_until(Duration::from_secs(60));
    assert_eq!(net.singleton, BTreeSet::from([1]));
}

#[test]
fn minority_of_a_clean_partition_downs_itself() {
    let mut net = Net::new(5, Duration::from_secs(5));
    net.step_until(Duration::from_secs(25));
    assert!(all_up(&net, &[0, 1, 2, 3, 4]), "{:?}", net.statuses(3));
    net.partition(&[0, 1, 2], &[3, 4]);
    net.step_until(Duration::from_secs(70));
    assert_eq!(net.stops.get(&3), Some(&StopReason::Downed));
    assert_eq!(net.stops.get(&4), Some(&StopReason::Downed));
    assert!(!net.stops.contains_key(&0));
    assert!(all_up(&net, &[0, 1, 2]), "{:?}", net.statuses(0));
}

#[test]
fn tie_keeps_the_side_with_the_lowest_address() {
    let mut net = Net::new(4, Duration::from_secs(5));
    net.step_until(Duration::from_secs(25));
    assert!(all_up(&net, &[0, 1, 2, 3]));
    net.partition(&[0, 1], &[2, 3]);
    net.step_until(Duration::from_secs(70));
    assert!(!net.stops.contains_key(&0) && !net.stops.contains_key(&1));
    assert!(net.stops.contains_key(&2) && net.stops.contains_key(&3));
}

#[test]
fn graceful_leave_ends_in_removed() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    let now = net.now;
    net.nodes[1].as_mut().unwrap().leave(now);
    net.drain(1);
    net.step_until(Duration::from_secs(40));
    assert_eq!(net.stops.get(&1), Some(&StopReason::Left));
    assert!(all_up(&net, &[0, 2]));
    assert!(net.events[0]
        .iter()
        .any(|e| matches!(e, ClusterEvent::MemberExited(_))));
    assert!(net.events[0].iter().any(|e| matches!(
        e,
        ClusterEvent::MemberRemoved {
            previous_status: MemberStatus::Exiting,
            ..
        }
    )));
}

/// Simulation seed membership-rolling-restart 31000797: the leader kept
/// gossiping its version to members that had not acknowledged it, and they
/// answered nothing because they already had that version, so the leader
/// never saw convergence and a graceful leave hung. A member that receives a
/// gossip whose seen set lacks it must tell the sender that it has seen it.
#[test]
fn gossip_that_has_not_seen_the_receiver_is_answered() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    assert!(all_up(&net, &[0, 1, 2]));
    let from = net.node(0).self_address().clone();
    let to = net.node(1).self_address().clone();
    let mut gossip = net.node(0).gossip().clone();
    assert_eq!(gossip.version, net.node(1).gossip().version, "same version");
    gossip.seen = BTreeSet::from([from.clone()]);
    let now = net.now;
    let n1 = net.nodes[1].as_mut().unwrap();
    while n1.poll_transmit().is_some() {}
    n1.handle_message(
        now,
        ClusterMessage::Gossip {
            from: from.clone(),
            to: to.clone(),
            gossip,
        },
    );
    let mut answered = false;
    while let Some(t) = n1.poll_transmit() {
        if let ClusterMessage::GossipStatus { to: dest, seen, .. } = &t.message {
            if *dest == from && t.to == from.address {
                assert!(seen.contains(&to), "the status says node 1 saw it");
                answered = true;
            }
        }
    }
    assert!(answered, "node 1 told node 0 that it has seen the version");
}

#[test]
fn a_join_is_gossiped_to_every_member_at_once() {
    // If the member that took the join crashed before its next gossip
    // round, the others would never learn of the joiner (they ignore gossip
    // from a member they do not know) and it would stay Joining for good.
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    assert!(all_up(&net, &[0, 1, 2]));
    let joiner = UniqueAddress {
        address: addr(3),
        uid: MemberUid(77),
    };
    let now = net.now;
    let n1 = net.nodes[1].as_mut().unwrap();
    while n1.poll_transmit().is_some() {}
    n1.handle_message(
        now,
        ClusterMessage::Join {
            from: joiner.clone(),
            roles: BTreeSet::new(),
        },
    );
    let mut told = BTreeSet::new();
    while let Some(t) = n1.poll_transmit() {
        if let ClusterMessage::Gossip { gossip, .. } = &t.message {
            assert!(
                gossip.members.contains_key(&joiner),
                "the gossip names the joiner"
            );
            told.insert(t.to.clone());
        }
    }
    assert!(
        told.contains(&addr(0)) && told.contains(&addr(2)),
        "every other member is told at once: {told:?}"
    );
}

#[test]
fn restarted_node_is_a_new_incarnation_and_the_old_one_is_removed() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    let old = net.node(2).self_address().clone();
    let fresh = net.make(2, 3, Duration::from_secs(5));
    net.nodes[2] = Some(fresh);
    net.step_until(Duration::from_secs(40));
    let g = net.node(0).gossip();
    assert!(
        all_up(&net, &[0, 1, 2]),
        "{:?} conv {} unreachable {:?} seen {:?} leader {:?}",
        net.statuses(0),
        g.convergence(),
        g.unreachable_members(),
        g.seen,
        net.node(0).leader()
    );
    assert!(net.node(0).gossip().tombstones.contains(&old));
}

#[test]
fn paused_member_learns_it_was_downed_and_stops() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    let paused = net.nodes[2].take();
    net.step_until(Duration::from_secs(60));
    assert!(net
        .node(0)
        .gossip()
        .tombstones
        .iter()
        .any(|t| t.address == addr(2)));
    net.nodes[2] = paused;
    let now = net.now;
    net.nodes[2].as_mut().unwrap().handle_timeout(now);
    // the very first input after the pause fences it
    assert!(!net.node(2).is_available());
    net.drain(2);
    net.step_until(Duration::from_secs(65));
    assert_eq!(net.stops.get(&2), Some(&StopReason::Downed));
}

/// Two members that downed each other (conflicting decisions taken while
/// partitioned; the simulation's `membership-unstable` seeds 330 and 1762
/// got there through the resolver, each member finding every other one
/// indirectly connected) both stop once they talk again: each answers the
/// other's probe with `Downed`, and that reply counts although its sender
/// is Down in the receiver's view. Ignoring it kept both running as two
/// clusters, each removing the other and hosting the coordinator.
#[test]
fn members_that_downed_each_other_both_stop() {
    let mut net = Net::new(2, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    assert!(all_up(&net, &[0, 1]), "{:?}", net.statuses(0));
    assert_eq!(net.singleton, BTreeSet::from([0]));
    net.partition(&[0], &[1]);
    let (u0, u1) = (
        net.node(0).self_address().clone(),
        net.node(1).self_address().clone(),
    );
    let now = net.now;
    net.nodes[0].as_mut().unwrap().down(now, &u1);
    net.nodes[1].as_mut().unwrap().down(now, &u0);
    net.drain(0);
    net.drain(1);
    assert!(!net.node(0).is_stopped() && !net.node(1).is_stopped());
    net.step_until(Duration::from_secs(21));
    net.cut.clear();
    // before the down-removal margin ends (each would then remove the
    // other and both would host the coordinator: `step_until` panics)
    net.step_until(Duration::from_secs(60));
    assert_eq!(net.stops.get(&0), Some(&StopReason::Downed));
    assert_eq!(net.stops.get(&1), Some(&StopReason::Downed));
    assert!(net.singleton.is_empty(), "{:?}", net.singleton);
}

#[test]
fn member_status_diagram_is_respected_by_events() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    // every status a member goes through on node 0 only moves forward
    let mut last: BTreeMap<UniqueAddress, MemberStatus> = BTreeMap::new();
    for e in &net.events[0] {
        let m = match e {
            ClusterEvent::MemberJoined(m)
            | ClusterEvent::MemberWeaklyUp(m)
            | ClusterEvent::MemberUp(m)
            | ClusterEvent::MemberLeft(m)
            | ClusterEvent::MemberExited(m)
            | ClusterEvent::MemberDowned(m) => m,
            _ => continue,
        };
        if let Some(prev) = last.get(&m.unique_address) {
            assert!(*prev == m.status || prev.can_transition_to(m.status));
        }
        last.insert(m.unique_address.clone(), m.status);
    }
}

// ----- properties -----

fn ua_strategy() -> impl Strategy<Value = UniqueAddress> {
    (0usize..4, 1u64..3).prop_map(|(a, u)| UniqueAddress {
        address: addr(a),
        uid: MemberUid(u),
    })
}

fn status_strategy() -> impl Strategy<Value = MemberStatus> {
    (0u8..6).prop_map(|c| MemberStatus::from_code(c).unwrap())
}

fn gossip_strategy() -> impl Strategy<Value = Gossip> {
    let members = proptest::collection::btree_map(
        ua_strategy(),
        (
            status_strategy(),
            0u32..4,
            proptest::collection::btree_set("[ab]", 0..2),
        ),
        0..6,
    );
    let records = proptest::collection::btree_map(
        ua_strategy(),
        (
            0u64..3,
            proptest::collection::btree_set(ua_strategy(), 0..3),
        ),
        0..3,
    );
    let seen = proptest::collection::btree_set(ua_strategy(), 0..4);
    let version = proptest::collection::btree_map(ua_strategy(), 0u64..3, 0..3);
    let tombstones = proptest::collection::btree_set(ua_strategy(), 0..2);
    (members, records, seen, version, tombstones).prop_map(|(m, r, seen, v, tombstones)| {
        let members = m
            .into_iter()
            .map(|(ua, (status, up_number, roles))| {
                (
                    ua.clone(),
                    Member {
                        unique_address: ua,
                        status,
                        roles,
                        up_number,
                    },
                )
            })
            .collect();
        let records = r
            .into_iter()
            .map(|(o, (version, unreachable))| {
                (
                    o,
                    ObserverRecord {
                        version,
                        unreachable,
                    },
                )
            })
            .collect();
        let mut version = VectorClock::new();
        for (u, c) in v {
            version.set(u, c);
        }
        let mut g = Gossip {
            members,
            reachability: Reachability { records },
            seen,
            version,
            tombstones,
        };
        g.normalize();
        g
    })
}

fn message_strategy() -> impl Strategy<Value = ClusterMessage> {
    let roles = proptest::collection::btree_set("[a-z]{0,6}", 0..3);
    prop_oneof![
        ua_strategy().prop_map(|from| ClusterMessage::InitJoin { from }),
        ua_strategy().prop_map(|from| ClusterMessage::InitJoinAck { from }),
        ua_strategy().prop_map(|from| ClusterMessage::InitJoinNack { from }),
        (ua_strategy(), roles).prop_map(|(from, roles)| ClusterMessage::Join { from, roles }),
        (ua_strategy(), ua_strategy(), gossip_strategy())
            .prop_map(|(from, to, gossip)| ClusterMessage::Welcome { from, to, gossip }),
        (ua_strategy(), ua_strategy(), gossip_strategy())
            .prop_map(|(from, to, gossip)| ClusterMessage::Gossip { from, to, gossip }),
        (ua_strategy(), ua_strategy(), gossip_strategy()).prop_map(|(from, to, g)| {
            ClusterMessage::GossipStatus {
                from,
                to,
                version: g.version,
                seen: g.seen,
            }
        }),
        (ua_strategy(), ua_strategy(), any::<u64>()).prop_map(|(from, to, sequence_nr)| {
            ClusterMessage::Heartbeat {
                from,
                to,
                sequence_nr,
            }
        }),
        (ua_strategy(), ua_strategy(), any::<u64>()).prop_map(|(from, to, sequence_nr)| {
            ClusterMessage::HeartbeatRsp {
                from,
                to,
                sequence_nr,
            }
        }),
        (ua_strategy(), ua_strategy()).prop_map(|(from, to)| ClusterMessage::Downed { from, to }),
        (ua_strategy(), ua_strategy())
            .prop_map(|(from, to)| ClusterMessage::HandOverToMe { from, to }),
        (ua_strategy(), ua_strategy())
            .prop_map(|(from, to)| ClusterMessage::HandOverDone { from, to }),
    ]
}

proptest! {
    #[test]
    fn merge_is_commutative(a in gossip_strategy(), b in gossip_strategy()) {
        prop_assert_eq!(a.merge(&b), b.merge(&a));
    }

    #[test]
    fn merge_is_associative(a in gossip_strategy(), b in gossip_strategy(), c in gossip_strategy()) {
        prop_assert_eq!(a.merge(&b).merge(&c), a.merge(&b.merge(&c)));
    }

    #[test]
    fn merge_is_idempotent(a in gossip_strategy(), b in gossip_strategy()) {
        prop_assert_eq!(a.merge(&a), a.clone());
        let ab = a.merge(&b);
        prop_assert_eq!(ab.merge(&b), ab.clone());
    }

    #[test]
    fn merge_version_dominates_inputs(a in gossip_strategy(), b in gossip_strategy()) {
        let m = a.merge(&b);
        prop_assert!(matches!(m.version.compare(&a.version), ClockOrdering::After | ClockOrdering::Same));
        prop_assert!(matches!(m.version.compare(&b.version), ClockOrdering::After | ClockOrdering::Same));
    }

    #[test]
    fn codec_round_trip(msg in message_strategy()) {
        let bytes = encode(&msg);
        prop_assert_eq!(decode(&bytes), Ok(msg));
    }

    #[test]
    fn decode_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&bytes);
        let mut framed = vec![WIRE_VERSION];
        framed.extend_from_slice(&bytes);
        let _ = decode(&framed);
    }

    #[test]
    fn decode_mutated_messages_never_panics(msg in message_strategy(), pos in any::<usize>(), byte in any::<u8>(), cut in any::<usize>()) {
        let mut bytes = encode(&msg);
        let p = pos % bytes.len();
        bytes[p] = byte;
        let _ = decode(&bytes);
        let c = cut % (bytes.len() + 1);
        let _ = decode(&bytes[..c]);
    }
}

#[test]
fn decode_errors_are_typed() {
    let ua = UniqueAddress {
        address: addr(0),
        uid: MemberUid(7),
    };
    let bytes = encode(&ClusterMessage::InitJoin { from: ua });
    assert_eq!(
        decode(&[]),
        Err(DecodeError::Truncated {
            offset: 0,
            needed_bytes: 1
        })
    );
    assert_eq!(decode(&[2, 1]), Err(DecodeError::UnsupportedVersion(2)));
    assert_eq!(
        decode(&[WIRE_VERSION, 99]),
        Err(DecodeError::UnknownTag(99))
    );
    assert!(matches!(
        decode(&bytes[..bytes.len() - 1]),
        Err(DecodeError::Truncated { .. })
    ));
    let mut long = bytes.clone();
    long.push(0);
    assert_eq!(decode(&long), Err(DecodeError::TrailingBytes(1)));
    // a huge count is refused before allocating
    let huge = [WIRE_VERSION, 1, 0xff, 0xff, 0xff, 0xff];
    assert!(matches!(
        decode(&huge),
        Err(DecodeError::LengthTooLarge {
            count: u32::MAX,
            ..
        })
    ));
    let mut bad_utf8 = vec![WIRE_VERSION, 1, 2, 0, 0, 0, 0xff, 0xfe];
    bad_utf8.extend_from_slice(&7u64.to_le_bytes());
    assert!(matches!(
        decode(&bad_utf8),
        Err(DecodeError::NotUtf8 { offset: 6 })
    ));
}

#[test]
fn sbr_strategies_decide_as_documented() {
    let u = |i: usize| UniqueAddress {
        address: addr(i),
        uid: MemberUid(i as u64 + 1),
    };
    // five Up members, observer 0 sees 3 and 4 unreachable
    let mut g = Gossip::default();
    for i in 0..5 {
        let mut m = Member::joining(u(i), BTreeSet::new());
        m.status = MemberStatus::Up;
        m.up_number = i as u32 + 1;
        g.members.insert(u(i), m);
    }
    g.reachability.unreachable(&u(0), &u(3));
    g.reachability.unreachable(&u(0), &u(4));
    let decide = |strategy: SbrStrategy, g: &Gossip, me: usize| {
        let mut sbr = SplitBrainResolver::new(SbrConfig {
            strategy,
            stable_after: Duration::from_secs(1),
            down_all_when_unstable: None,
            role: None,
        });
        let view = DowningView {
            gossip: g,
            self_address: &u(me),
            is_leader: true,
        };
        assert!(sbr.update(Duration::ZERO, view).is_none());
        sbr.update(Duration::from_secs(1), view).unwrap()
    };
    let set = |v: &[usize]| v.iter().map(|i| u(*i)).collect::<BTreeSet<_>>();
    let d = decide(SbrStrategy::KeepMajority, &g, 0);
    assert_eq!(
        (d.down, d.reason),
        (set(&[3, 4]), DecisionReason::DownUnreachable)
    );
    let d = decide(SbrStrategy::StaticQuorum { quorum_size: 4 }, &g, 0);
    assert_eq!(d.down, set(&[0, 1, 2]));
    let d = decide(
        SbrStrategy::KeepOldest {
            down_if_alone: true,
        },
        &g,
        0,
    );
    assert_eq!(d.down, set(&[3, 4]));
    let d = decide(SbrStrategy::DownAll, &g, 0);
    assert_eq!(d.down, set(&[0, 1, 2, 3, 4]));
    // the minority's view: 0, 1, 2 unreachable from 3
    let mut h = g.clone();
    h.reachability = Reachability::default();
    for i in 0..3 {
        h.reachability.unreachable(&u(3), &u(i));
    }
    let d = decide(SbrStrategy::KeepMajority, &h, 3);
    assert_eq!(
        (d.down, d.reason),
        (set(&[3, 4]), DecisionReason::DownReachable)
    );
    let d = decide(
        SbrStrategy::KeepOldest {
            down_if_alone: true,
        },
        &h,
        3,
    );
    assert_eq!(d.down, set(&[3, 4]));
    // keep-oldest with the oldest alone: it is downed
    let mut k = g.clone();
    k.reachability = Reachability::default();
    for i in 1..5 {
        k.reachability.unreachable(&u(0), &u(i));
    }
    let d = decide(
        SbrStrategy::KeepOldest {
            down_if_alone: true,
        },
        &k,
        0,
    );
    assert_eq!(d.down, set(&[0]));
    let d = decide(
        SbrStrategy::KeepOldest {
            down_if_alone: false,
        },
        &k,
        0,
    );
    assert_eq!(d.down, set(&[1, 2, 3, 4]));
    // indirectly connected: 0 and 1 observe each other, both reach the rest
    let mut ic = g.clone();
    ic.reachability = Reachability::default();
    ic.reachability.unreachable(&u(0), &u(1));
    ic.reachability.unreachable(&u(1), &u(0));
    let d = decide(SbrStrategy::KeepMajority, &ic, 2);
    assert_eq!(
        (d.down, d.reason),
        (set(&[0, 1]), DecisionReason::DownIndirectlyConnected)
    );
}

#[test]
fn sbr_waits_for_stability_and_downs_all_when_unstable() {
    let u = |i: usize| UniqueAddress {
        address: addr(i),
        uid: MemberUid(i as u64 + 1),
    };
    let mut g = Gossip::default();
    for i in 0..3 {
        let mut m = Member::joining(u(i), BTreeSet::new());
        m.status = MemberStatus::Up;
        m.up_number = i as u32 + 1;
        g.members.insert(u(i), m);
    }
    let mut sbr = SplitBrainResolver::new(SbrConfig::with_stable_after(Duration::from_secs(10)));
    let me = u(0);
    // flapping: the unreachable set changes every 5 s, never stable for 10 s
    let mut t = Duration::ZERO;
    let mut decision = None;
    for step in 0..20 {
        g.reachability = Reachability::default();
        g.reachability.unreachable(&u(0), &u(1 + step % 2));
        let view = DowningView {
            gossip: &g,
            self_address: &me,
            is_leader: true,
        };
        if let Some(d) = sbr.update(t, view) {
            decision = Some((t, d));
            break;
        }
        t += Duration::from_secs(5);
    }
    let (at, d) = decision.expect("down-all-when-unstable fires");
    assert_eq!(d.reason, DecisionReason::DownAllWhenUnstable);
    // stable_after 10 s + 7.5 s
    assert!(
        at >= Duration::from_millis(17_500) && at <= Duration::from_secs(20),
        "{at:?}"
    );
    assert_eq!(d.down.len(), 3);
}

#[test]
fn joining_member_becomes_weakly_up_while_a_member_is_unreachable() {
    let stable = Duration::from_secs(120);
    let mut net = Net::new(4, stable);
    net.nodes[3] = None;
    net.step_until(Duration::from_secs(20));
    assert!(all_up(&net, &[0, 1, 2]));
    net.nodes[2] = None; // crashed, not downed for 120 s
    net.step_until(Duration::from_secs(30));
    assert!(!net.node(0).gossip().convergence());
    let joiner = net.make(3, 4, stable);
    net.nodes[3] = Some(joiner);
    net.step_until(Duration::from_secs(50));
    let me = net.node(3).self_address().clone();
    let status = net.node(0).gossip().member(&me).map(|m| m.status);
    assert_eq!(status, Some(MemberStatus::WeaklyUp));
    assert!(net.node(3).is_available());
    assert!(net.events[0]
        .iter()
        .any(|e| matches!(e, ClusterEvent::MemberWeaklyUp(_))));
    // once the crashed member is downed and removed, it becomes Up
    let crashed = net
        .node(0)
        .gossip()
        .members
        .keys()
        .find(|u| u.address == addr(2))
        .cloned()
        .unwrap();
    let now = net.now;
    net.nodes[0].as_mut().unwrap().down(now, &crashed);
    net.drain(0);
    net.step_until(Duration::from_secs(90));
    assert_eq!(
        net.node(0).gossip().member(&me).map(|m| m.status),
        Some(MemberStatus::Up)
    );
}

/// The first seed forms a cluster of its own only when no other seed
/// answers: a seed that refused it (a mismatched `number_of_shards`, say)
/// answered, so it keeps asking and never forms one.
#[test]
fn a_first_seed_refused_by_another_seed_never_forms_its_own_cluster() {
    let seeds = vec![addr(0), addr(1)];
    let mut alone = ClusterNode::new(
        ClusterConfig::new(addr(0), seeds.clone()),
        MemberUid(1),
        Duration::ZERO,
    );
    let mut refused = ClusterNode::new(
        ClusterConfig::new(addr(0), seeds),
        MemberUid(2),
        Duration::ZERO,
    );
    refused.handle_seed_refused(ms(100), &addr(1), "sharding fingerprint mismatch");
    // Not a seed: ignored.
    refused.handle_seed_refused(ms(100), &addr(7), "other");
    assert_eq!(
        refused.join_refused(),
        Some("127.0.0.2:7101: sharding fingerprint mismatch")
    );
    for t in (0..=30_000).step_by(250) {
        let now = ms(t);
        for n in [&mut alone, &mut refused] {
            if n.poll_timeout().is_some_and(|d| d <= now) {
                n.handle_timeout(now);
            }
            while n.poll_transmit().is_some() {}
        }
    }
    // Without an answer the first seed formed its cluster after 5 s; the
    // refused one is still no member and still asks the seeds.
    assert!(alone.self_member().is_some());
    assert!(refused.self_member().is_none());
    assert!(refused.join_refused().is_some());
    let mut asked = 0;
    refused.handle_timeout(ms(31_000));
    while let Some(t) = refused.poll_transmit() {
        asked += usize::from(matches!(t.message, ClusterMessage::InitJoin { .. }));
    }
    assert!(asked > 0, "keeps sending InitJoin");
}

fn removed_at(net: &Net, observer: usize, slot: usize) -> bool {
    net.node(observer)
        .gossip()
        .tombstones
        .iter()
        .any(|t| t.address == addr(slot))
}

/// Steps until `cond` holds (or `limit`); returns the time it held.
fn step_until_cond(net: &mut Net, limit: Duration, cond: impl Fn(&Net) -> bool) -> Duration {
    while net.now < limit && !cond(net) {
        let t = net.now + ms(10);
        net.step_until(t);
    }
    net.now
}

#[test]
fn a_crashed_process_whose_port_refuses_is_removed_without_stable_after() {
    let stable_after = Duration::from_secs(5);
    let mut net = Net::new(3, stable_after);
    net.step_until(Duration::from_secs(20));
    assert!(all_up(&net, &[0, 1, 2]));
    let crashed_at = net.now;
    net.nodes[2] = None;
    net.refusing.insert(2);
    let at = step_until_cond(&mut net, crashed_at + Duration::from_secs(20), |n| {
        removed_at(n, 0, 2) && removed_at(n, 1, 2)
    });
    // one heartbeat interval to the first refusal, two probes, one round
    // of gossip: far below stable_after (let alone the removal margin)
    assert!(
        at - crashed_at < Duration::from_millis(2_500),
        "removed {:?} after the crash",
        at - crashed_at
    );
    assert!(net.events[0].iter().any(
        |e| matches!(e, ClusterEvent::MemberDowned(m) if m.unique_address.address == addr(2))
    ));
    net.step_until(at + Duration::from_secs(10));
    assert!(all_up(&net, &[0, 1]), "{:?}", net.statuses(0));
    assert!(net.stops.is_empty(), "{:?}", net.stops);
}

#[test]
fn the_oldest_crashing_with_a_refusing_port_moves_the_singleton_fast() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    assert_eq!(net.singleton, BTreeSet::from([0]));
    let crashed_at = net.now;
    net.nodes[0] = None;
    net.refusing.insert(0);
    net.singleton.clear();
    let at = step_until_cond(&mut net, crashed_at + Duration::from_secs(20), |n| {
        n.singleton == BTreeSet::from([1])
    });
    assert!(
        at - crashed_at < Duration::from_millis(3_000),
        "singleton moved {:?} after the crash",
        at - crashed_at
    );
}

#[test]
fn refusals_interrupted_by_a_message_down_nothing() {
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    let victim = net.node(2).self_address().clone();
    let now = net.now;
    for k in 0..2 {
        let t = now + ms(150 * k);
        net.nodes[0]
            .as_mut()
            .unwrap()
            .handle_connection_refused(t, &addr(2));
    }
    assert_eq!(net.node(0).refused_count(&victim), 2);
    // a burst at one instant counts once
    for _ in 0..5 {
        net.nodes[0]
            .as_mut()
            .unwrap()
            .handle_connection_refused(now + ms(150), &addr(2));
    }
    assert_eq!(net.node(0).refused_count(&victim), 2);
    net.drain(0);
    // the member answers the probes: the count starts again
    net.step_until(now + Duration::from_secs(3));
    assert_eq!(net.node(0).refused_count(&victim), 0);
    net.step_until(now + Duration::from_secs(30));
    assert!(all_up(&net, &[0, 1, 2]), "{:?}", net.statuses(0));
    assert!(net.stops.is_empty());
}

#[test]
fn refusals_while_another_member_is_unreachable_by_timeouts_wait_for_the_resolver() {
    let stable_after = Duration::from_secs(5);
    let mut net = Net::new(5, stable_after);
    net.step_until(Duration::from_secs(25));
    assert!(all_up(&net, &[0, 1, 2, 3, 4]), "{:?}", net.statuses(0));
    // node 4 crashes with a refusing port; node 3 is cut off (timeouts only)
    let t0 = net.now;
    net.nodes[4] = None;
    net.refusing.insert(4);
    net.partition(&[0, 1, 2], &[3]);
    // before node 3 is seen unreachable the refused node 4 may be downed at
    // once; once node 3 is unreachable nothing is decided before
    // stable_after
    let unreachable3 = step_until_cond(&mut net, t0 + Duration::from_secs(20), |n| {
        n.node(0)
            .gossip()
            .unreachable_members()
            .iter()
            .any(|u| u.address == addr(3))
    });
    let downed3 = step_until_cond(&mut net, t0 + Duration::from_secs(60), |n| {
        n.node(0)
            .gossip()
            .members
            .values()
            .any(|m| m.unique_address.address == addr(3) && m.status == MemberStatus::Down)
            || removed_at(n, 0, 3)
    });
    assert!(
        downed3 >= unreachable3 + stable_after,
        "node 3 downed {:?} after it became unreachable",
        downed3 - unreachable3
    );
    net.step_until(downed3 + Duration::from_secs(40));
    assert!(all_up(&net, &[0, 1, 2]), "{:?}", net.statuses(0));
    assert_eq!(net.stops.get(&3), Some(&StopReason::Downed));
}

#[test]
fn a_partition_that_refuses_both_ways_keeps_the_majority_only() {
    // A firewall answering with resets looks like dead processes to both
    // sides: the strategy still decides, the minority downs itself.
    let mut net = Net::new(5, Duration::from_secs(5));
    net.step_until(Duration::from_secs(25));
    assert!(all_up(&net, &[0, 1, 2, 3, 4]));
    for a in [0, 1, 2] {
        for b in [3, 4] {
            net.refusing_links.insert((a, b));
            net.refusing_links.insert((b, a));
        }
    }
    let t0 = net.now;
    net.step_until(t0 + Duration::from_secs(40));
    assert_eq!(net.stops.get(&3), Some(&StopReason::Downed));
    assert_eq!(net.stops.get(&4), Some(&StopReason::Downed));
    assert!(!net.stops.contains_key(&0), "{:?}", net.stops);
    assert!(all_up(&net, &[0, 1, 2]), "{:?}", net.statuses(0));
}

#[test]
fn a_paused_member_is_not_downed_by_refusals_it_never_gave() {
    // A paused process keeps its port open: connections queue, nothing is
    // refused; the resolver's rules apply, and a short pause downs nothing.
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(20));
    let paused = net.nodes[2].take();
    let t0 = net.now;
    net.step_until(t0 + Duration::from_millis(2_500));
    net.nodes[2] = paused;
    net.step_until(t0 + Duration::from_secs(30));
    assert!(all_up(&net, &[0, 1, 2]), "{:?}", net.statuses(0));
    assert!(net.stops.is_empty(), "{:?}", net.stops);
}

#[test]
fn seeds_started_at_once_form_without_waiting_for_the_seed_timeout() {
    // Every other seed answers InitJoinNack (not a member of any cluster):
    // the first seed forms at once and tells them, they join, the leader
    // makes them Up at the next convergence and tells each (Akka's
    // FirstSeedNodeProcess); nothing waits for seed_node_timeout (5 s) or
    // for a 1 s tick.
    let mut net = Net::new(3, Duration::from_secs(5));
    let at = step_until_cond(&mut net, Duration::from_secs(10), |n| {
        all_up(n, &[0, 1, 2]) && n.singleton == BTreeSet::from([0])
    });
    assert!(at < ms(500), "all Up with a coordinator after {at:?}");
    // A first seed restarted while the other seeds are members gets their
    // InitJoinAck and joins them: it never forms an island.
    let mut net = Net::new(3, Duration::from_secs(5));
    net.step_until(Duration::from_secs(3));
    let fresh = net.make(0, 3, Duration::from_secs(5));
    net.nodes[0] = Some(fresh);
    net.singleton.remove(&0); // it crashed with the old incarnation
    net.step_until(Duration::from_secs(20));
    assert!(all_up(&net, &[0, 1, 2]), "{:?}", net.statuses(1));
    assert_eq!(net.node(1).gossip().members.len(), 3);
}
