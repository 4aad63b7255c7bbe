//! Downing: the pluggable provider that decides which unreachable members are
//! marked Down, and the split-brain resolver (Akka's `SplitBrainResolver`,
//! <https://doc.akka.io/docs/akka/current/split-brain-resolver.html>).
//!
//! The resolver acts on the leader of each side of a partition once the set
//! of unreachable members (and the set of members) has not changed for
//! `stable_after`; a member that is not the leader applies only the part of
//! the decision that downs itself (so a side that loses stops even when its
//! leader's last gossip is lost). Members that are only indirectly connected (they observe
//! and are observed unreachable, or are observed unreachable although they
//! have seen the current gossip) are downed, and the strategy decides between
//! the remaining sides. There is no auto-down by timeout.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use super::gossip::Gossip;
use super::member::{Member, MemberStatus};
use crate::ids::UniqueAddress;

/// What a downing provider sees at each call.
#[derive(Debug, Clone, Copy)]
pub struct DowningView<'a> {
    /// The local membership state.
    pub gossip: &'a Gossip,
    /// This member.
    pub self_address: &'a UniqueAddress,
    /// Whether this member is the leader of its side (only the leader acts).
    pub is_leader: bool,
}

/// A decision: the members to mark Down.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DowningDecision {
    /// Members to mark Down (may include this member).
    pub down: BTreeSet<UniqueAddress>,
    /// Which rule produced the decision.
    pub reason: DecisionReason,
}

/// Why a decision was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DecisionReason {
    /// The strategy kept this side and downs the unreachable members.
    DownUnreachable,
    /// The strategy downs this side (including this member).
    DownReachable,
    /// Every member is downed (`down-all`, or a `static-quorum` that both
    /// sides would meet).
    DownAll,
    /// Only indirectly connected members are unreachable; they are downed.
    DownIndirectlyConnected,
    /// The unreachable set kept changing for longer than `stable_after +
    /// down_all_when_unstable`: every member is downed.
    DownAllWhenUnstable,
    /// Members whose cluster ports refused connections (their processes are
    /// gone) are downed at once, the strategy keeping this side.
    DownRefused,
}

/// A pluggable downing provider (Akka's `DowningProvider`).
///
/// The node calls [`DowningProvider::update`] after every input; the
/// provider returns a decision when it wants members downed. It must not
/// read a clock: time comes in as `now`.
pub trait DowningProvider: fmt::Debug + Send {
    /// Observes the membership state at `now` and maybe decides.
    fn update(&mut self, now: Duration, view: DowningView<'_>) -> Option<DowningDecision>;
    /// The next time the provider wants to be called even without input.
    fn next_deadline(&self) -> Option<Duration>;
    /// Observes that this node confirmed refused connections from every
    /// member of `refused` (no process listens at their cluster ports; see
    /// `ClusterConfig::refusals_to_down`) and maybe decides at once,
    /// without waiting for stability. Called on every member, leader or
    /// not. The default never decides (the provider's own rules apply).
    fn decide_refused(
        &mut self,
        now: Duration,
        view: DowningView<'_>,
        refused: &BTreeSet<UniqueAddress>,
    ) -> Option<DowningDecision> {
        let _ = (now, view, refused);
        None
    }
}

/// A provider that never downs anything (downing left to an operator).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoDowning;

impl DowningProvider for NoDowning {
    fn update(&mut self, _now: Duration, _view: DowningView<'_>) -> Option<DowningDecision> {
        None
    }
    fn next_deadline(&self) -> Option<Duration> {
        None
    }
}

/// The split-brain resolver's strategy (Akka's `active-strategy`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SbrStrategy {
    /// Keep the side with more members; on a tie the side with the lowest
    /// address survives. The default. Members already Down but not yet
    /// removed count with the unreachable side (they may still run there).
    KeepMajority,
    /// Keep the side with at least `quorum_size` members (count); downs
    /// everything if both sides would have it.
    StaticQuorum {
        /// Minimum number of members for a side to survive.
        quorum_size: usize,
    },
    /// Keep the side with the oldest member. With `down_if_alone` (Akka's
    /// default on) an oldest member alone on its side is downed instead and
    /// the other side survives.
    KeepOldest {
        /// Down the oldest when it is alone and the other side is not empty.
        down_if_alone: bool,
    },
    /// Down every member.
    DownAll,
}

/// Settings of the [`SplitBrainResolver`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SbrConfig {
    /// The strategy. Default keep-majority.
    pub strategy: SbrStrategy,
    /// How long the unreachable set must be unchanged before a decision.
    /// Default 20 s.
    pub stable_after: Duration,
    /// When `Some(d)`, every member is downed if no decision could be made
    /// within `stable_after + d` of the first unreachability (Akka's
    /// `down-all-when-unstable`, default on = 3/4 of `stable_after`, at
    /// least 4 s). `None` disables it.
    pub down_all_when_unstable: Option<Duration>,
    /// Count only members with this role. Default none (all members).
    pub role: Option<String>,
}

impl Default for SbrConfig {
    fn default() -> Self {
        Self::with_stable_after(Duration::from_secs(20))
    }
}

impl SbrConfig {
    /// Keep-majority with the given `stable_after` and Akka's default
    /// `down_all_when_unstable` (3/4 of `stable_after`, at least 4 s).
    pub fn with_stable_after(stable_after: Duration) -> Self {
        let unstable = (stable_after * 3 / 4).max(Duration::from_secs(4));
        Self {
            strategy: SbrStrategy::KeepMajority,
            stable_after,
            down_all_when_unstable: Some(unstable),
            role: None,
        }
    }
}

/// The split-brain resolver, a [`DowningProvider`].
#[derive(Debug, Clone)]
pub struct SplitBrainResolver {
    config: SbrConfig,
    observed: Option<(BTreeSet<UniqueAddress>, BTreeSet<UniqueAddress>)>,
    stable_deadline: Option<Duration>,
    unstable_since: Option<Duration>,
}

impl SplitBrainResolver {
    /// A resolver with `config`.
    pub fn new(config: SbrConfig) -> Self {
        Self {
            config,
            observed: None,
            stable_deadline: None,
            unstable_since: None,
        }
    }

    fn counted<'a>(
        &self,
        g: &'a Gossip,
        set: &'a BTreeSet<UniqueAddress>,
    ) -> impl Iterator<Item = &'a Member> + 'a {
        let role = self.config.role.clone();
        set.iter().filter_map(move |u| {
            g.members.get(u).filter(|m| {
                matches!(m.status, MemberStatus::Up | MemberStatus::Leaving)
                    && m.has_role(role.as_deref())
            })
        })
    }

    /// The strategy's decision between `reachable` (this side) and
    /// `unreachable`.
    fn strategy(
        &self,
        g: &Gossip,
        reachable: &BTreeSet<UniqueAddress>,
        unreachable: &BTreeSet<UniqueAddress>,
    ) -> (BTreeSet<UniqueAddress>, DecisionReason) {
        let r: Vec<&Member> = self.counted(g, reachable).collect();
        let u: Vec<&Member> = self.counted(g, unreachable).collect();
        // Members already Down but not yet removed may still run on the other
        // side (they are removed only after `down_removal_margin`, and a
        // partition can keep them from learning their fate): the counting
        // strategies count them with the unreachable side, so that a side
        // that downed them cannot also win against the side they are on.
        let role = self.config.role.as_deref();
        let pending: Vec<&Member> = g
            .members
            .values()
            .filter(|m| m.status == MemberStatus::Down && m.up_number != 0 && m.has_role(role))
            .collect();
        let u_counted = u.len() + pending.len();
        let down_u = (unreachable.clone(), DecisionReason::DownUnreachable);
        let down_r = (reachable.clone(), DecisionReason::DownReachable);
        let all: BTreeSet<UniqueAddress> = reachable.union(unreachable).cloned().collect();
        match &self.config.strategy {
            SbrStrategy::KeepMajority => {
                if r.len() > u_counted {
                    down_u
                } else if r.len() < u_counted {
                    down_r
                } else {
                    let lowest = if r.is_empty() {
                        all.iter().next().cloned()
                    } else {
                        r.iter()
                            .chain(u.iter())
                            .chain(pending.iter())
                            .map(|m| m.unique_address.clone())
                            .min()
                    };
                    match lowest {
                        Some(l) if reachable.contains(&l) => down_u,
                        Some(_) => down_r,
                        None => down_u,
                    }
                }
            }
            SbrStrategy::StaticQuorum { quorum_size } => {
                if r.len() >= *quorum_size && u_counted >= *quorum_size {
                    (all, DecisionReason::DownAll)
                } else if r.len() >= *quorum_size {
                    down_u
                } else {
                    down_r
                }
            }
            SbrStrategy::KeepOldest { down_if_alone } => {
                let oldest = r.iter().chain(u.iter()).copied().reduce(|a, b| {
                    if b.is_older_than(a) {
                        b
                    } else {
                        a
                    }
                });
                match oldest {
                    None => down_u,
                    Some(o) if reachable.contains(&o.unique_address) => {
                        if *down_if_alone && r.len() == 1 && !u.is_empty() {
                            down_r
                        } else {
                            down_u
                        }
                    }
                    Some(_) => {
                        if *down_if_alone && u.len() == 1 && !r.is_empty() {
                            down_u
                        } else {
                            down_r
                        }
                    }
                }
            }
            SbrStrategy::DownAll => (all, DecisionReason::DownAll),
        }
    }

    /// The full decision (Akka's `SplitBrainResolverBase.decide`).
    fn decide(&self, g: &Gossip, self_ua: &UniqueAddress) -> DowningDecision {
        let live: BTreeSet<UniqueAddress> = g
            .members
            .values()
            .filter(|m| m.status != MemberStatus::Down)
            .map(|m| m.unique_address.clone())
            .collect();
        let unreachable: BTreeSet<UniqueAddress> = g
            .unreachable_members()
            .into_iter()
            .filter(|u| live.contains(u) && u != self_ua)
            .collect();
        let indirect = indirectly_connected(g, &live);
        if indirect.is_empty() {
            let reachable = live.difference(&unreachable).cloned().collect();
            let (down, reason) = self.strategy(g, &reachable, &unreachable);
            return DowningDecision { down, reason };
        }
        if unreachable.difference(&indirect).next().is_none() {
            return DowningDecision {
                down: indirect,
                reason: DecisionReason::DownIndirectlyConnected,
            };
        }
        let u2: BTreeSet<UniqueAddress> = unreachable.union(&indirect).cloned().collect();
        let reachable: BTreeSet<UniqueAddress> = live.difference(&u2).cloned().collect();
        let (mut down, reason) = self.strategy(g, &reachable, &u2);
        down.extend(indirect);
        DowningDecision { down, reason }
    }
}

/// Members only indirectly connected (Akka): those that are both observer and
/// subject of an unreachability record, and the two ends of a record whose
/// subject has seen the current gossip (so it is in fact connected).
pub fn indirectly_connected(g: &Gossip, live: &BTreeSet<UniqueAddress>) -> BTreeSet<UniqueAddress> {
    let mut observers = BTreeSet::new();
    let mut subjects = BTreeSet::new();
    let mut out = BTreeSet::new();
    for (obs, rec) in &g.reachability.records {
        if !live.contains(obs) {
            continue;
        }
        for s in &rec.unreachable {
            if !live.contains(s) {
                continue;
            }
            observers.insert(obs.clone());
            subjects.insert(s.clone());
            if g.seen.contains(s) {
                out.insert(obs.clone());
                out.insert(s.clone());
            }
        }
    }
    out.extend(observers.intersection(&subjects).cloned());
    out
}

impl DowningProvider for SplitBrainResolver {
    fn update(&mut self, now: Duration, view: DowningView<'_>) -> Option<DowningDecision> {
        let g = view.gossip;
        let unreachable: BTreeSet<UniqueAddress> = g
            .unreachable_members()
            .into_iter()
            .filter(|u| {
                g.members
                    .get(u)
                    .is_some_and(|m| m.status != MemberStatus::Down)
            })
            .collect();
        if unreachable.is_empty() {
            self.observed = None;
            self.stable_deadline = None;
            self.unstable_since = None;
            return None;
        }
        let live: BTreeSet<UniqueAddress> = g
            .members
            .values()
            .filter(|m| m.status != MemberStatus::Down)
            .map(|m| m.unique_address.clone())
            .collect();
        let key = (unreachable, live);
        if self.observed.as_ref() != Some(&key) {
            self.observed = Some(key);
            self.stable_deadline = Some(now + self.config.stable_after);
            self.unstable_since.get_or_insert(now);
        }
        let decision = if self.stable_deadline.is_some_and(|d| now >= d) {
            Some(self.decide(g, view.self_address))
        } else {
            match (self.config.down_all_when_unstable, self.unstable_since) {
                (Some(extra), Some(since)) if now >= since + self.config.stable_after + extra => {
                    let down = g
                        .members
                        .values()
                        .filter(|m| m.status != MemberStatus::Down)
                        .map(|m| m.unique_address.clone())
                        .collect();
                    Some(DowningDecision {
                        down,
                        reason: DecisionReason::DownAllWhenUnstable,
                    })
                }
                _ => None,
            }
        };
        let decision = decision?;
        self.stable_deadline = None;
        self.unstable_since = None;
        if view.is_leader {
            return Some(decision);
        }
        // A member that is not the leader acts only on the part of the
        // decision that downs itself: stopping is always safe, and it must not
        // depend on the leader's last gossip arriving.
        decision
            .down
            .contains(view.self_address)
            .then(|| DowningDecision {
                down: BTreeSet::from([view.self_address.clone()]),
                reason: decision.reason,
            })
    }

    /// Downs the refused members at once when the strategy, deciding
    /// between them and every other live member, keeps this side; downs
    /// this node alone when it keeps the other side (stopping is always
    /// safe); otherwise (another unreachable member, an indirectly
    /// connected one, or `down-all`) it leaves the decision to
    /// [`Self::update`]'s rules and `stable_after`.
    fn decide_refused(
        &mut self,
        _now: Duration,
        view: DowningView<'_>,
        refused: &BTreeSet<UniqueAddress>,
    ) -> Option<DowningDecision> {
        let g = view.gossip;
        let me = view.self_address;
        let live: BTreeSet<UniqueAddress> = g
            .members
            .values()
            .filter(|m| m.status != MemberStatus::Down)
            .map(|m| m.unique_address.clone())
            .collect();
        let refused: BTreeSet<UniqueAddress> = refused
            .iter()
            .filter(|u| live.contains(*u) && *u != me)
            .cloned()
            .collect();
        if refused.is_empty() || !live.contains(me) {
            return None;
        }
        // Any unreachability without that evidence (a partition, a paused
        // process, a lossy link): today's rules, unchanged.
        let unreachable = g.unreachable_members();
        if unreachable
            .iter()
            .any(|u| live.contains(u) && u != me && !refused.contains(u))
        {
            return None;
        }
        if !indirectly_connected(g, &live).is_empty() {
            return None;
        }
        let reachable: BTreeSet<UniqueAddress> = live.difference(&refused).cloned().collect();
        let (down, reason) = self.strategy(g, &reachable, &refused);
        match reason {
            DecisionReason::DownUnreachable if down.is_subset(&refused) => Some(DowningDecision {
                down,
                reason: DecisionReason::DownRefused,
            }),
            DecisionReason::DownReachable if down.contains(me) => Some(DowningDecision {
                down: BTreeSet::from([me.clone()]),
                reason,
            }),
            _ => None,
        }
    }

    fn next_deadline(&self) -> Option<Duration> {
        let unstable = match (self.config.down_all_when_unstable, self.unstable_since) {
            (Some(extra), Some(since)) => Some(since + self.config.stable_after + extra),
            _ => None,
        };
        match (self.stable_deadline, unstable) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
