//! Shard allocation strategies (Akka's `ShardAllocationStrategy` and
//! `LeastShardAllocationStrategy`, see "Shard allocation" in the Akka Cluster
//! Sharding docs).

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use crate::ids::{RegionId, ShardId};

/// Errors a strategy may return; the coordinator logs them, counts them and
/// carries on (the request is retried by the region; no rebalance this round).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum StrategyError {
    /// No region may host a shard now.
    #[error("no region is eligible to host shards")]
    NoEligibleRegion,
    /// The strategy failed for its own reason.
    #[error("allocation strategy failed: {0}")]
    Failed(String),
}

/// Decides where new shards go and which shards move.
///
/// `current` maps every region that may host shards now (its member is Up and
/// it is not shutting down) to the shards it hosts, sorted. A strategy that
/// returns an error, a region not in `current`, or panics, does not wedge the
/// coordinator: the allocation is retried later and the rebalance round is
/// skipped.
pub trait ShardAllocationStrategy {
    /// Picks the home of a shard that has none. `requester` is the region
    /// that asked. Also called when a rebalance round starts, with the
    /// shard's owner as `requester` and the loads after the round's earlier
    /// moves, to plan each moved shard's target (shown in the allocation
    /// table; the shard's home is still chosen by a later call).
    ///
    /// # Errors
    /// [`StrategyError::NoEligibleRegion`] when `current` is empty, or any
    /// strategy-specific failure.
    fn allocate_shard(
        &mut self,
        requester: &RegionId,
        shard: ShardId,
        current: &BTreeMap<RegionId, Vec<ShardId>>,
    ) -> Result<RegionId, StrategyError>;

    /// Picks the shards to hand off in this rebalance round;
    /// `in_progress` are shards already handing off.
    ///
    /// # Errors
    /// Any strategy-specific failure (the round is skipped).
    fn rebalance(
        &mut self,
        current: &BTreeMap<RegionId, Vec<ShardId>>,
        in_progress: &BTreeSet<ShardId>,
    ) -> Result<BTreeSet<ShardId>, StrategyError>;
}

/// The default strategy: a new shard goes to the region with the fewest
/// shards (ties: the smallest [`RegionId`], so the choice is deterministic);
/// a rebalance round moves shards from the most- to the least-loaded regions,
/// at most `min(rebalance_absolute_limit, max(1, rebalance_relative_limit *
/// number of allocated shards))` shards, and moves nothing once the most- and
/// least-loaded regions differ by at most 1 shard. No round starts while an
/// earlier one is still in progress. Follows Akka's
/// `LeastShardAllocationStrategy(absoluteLimit, relativeLimit)`.
#[derive(Debug, Clone, PartialEq)]
pub struct LeastShardAllocationStrategy {
    /// Most shards moved per round (count). Default 20.
    pub rebalance_absolute_limit: usize,
    /// Most shards moved per round as a share of all allocated shards.
    /// Default 0.1.
    pub rebalance_relative_limit: f64,
}

impl Default for LeastShardAllocationStrategy {
    fn default() -> Self {
        Self {
            rebalance_absolute_limit: 20,
            rebalance_relative_limit: 0.1,
        }
    }
}

impl ShardAllocationStrategy for LeastShardAllocationStrategy {
    fn allocate_shard(
        &mut self,
        _requester: &RegionId,
        _shard: ShardId,
        current: &BTreeMap<RegionId, Vec<ShardId>>,
    ) -> Result<RegionId, StrategyError> {
        current
            .iter()
            .min_by_key(|(r, s)| (s.len(), *r))
            .map(|(r, _)| r.clone())
            .ok_or(StrategyError::NoEligibleRegion)
    }

    fn rebalance(
        &mut self,
        current: &BTreeMap<RegionId, Vec<ShardId>>,
        in_progress: &BTreeSet<ShardId>,
    ) -> Result<BTreeSet<ShardId>, StrategyError> {
        let mut out = BTreeSet::new();
        if !in_progress.is_empty() || current.len() < 2 {
            return Ok(out);
        }
        let total: usize = current.values().map(Vec::len).sum();
        let relative = (self.rebalance_relative_limit * total as f64).floor() as usize;
        let limit = self.rebalance_absolute_limit.min(relative.max(1));
        // Counts we mutate as we plan moves; shards to take, per region.
        let mut counts: BTreeMap<&RegionId, usize> =
            current.iter().map(|(r, s)| (r, s.len())).collect();
        let mut taken: BTreeMap<&RegionId, usize> = BTreeMap::new();
        while out.len() < limit {
            let (most, most_n) = counts
                .iter()
                .max_by_key(|(r, n)| (**n, std::cmp::Reverse(**r)))
                .map(|(r, n)| (*r, *n))
                .expect("at least two regions");
            let (least, least_n) = counts
                .iter()
                .min_by_key(|(r, n)| (**n, **r))
                .map(|(r, n)| (*r, *n))
                .expect("at least two regions");
            if most_n <= least_n + 1 {
                break;
            }
            let t = taken.entry(most).or_insert(0);
            let shards = &current[most];
            // Take from the end of the sorted list: the highest shard ids.
            let Some(shard) = shards.iter().rev().nth(*t) else {
                break;
            };
            *t += 1;
            out.insert(*shard);
            *counts.get_mut(most).expect("present") -= 1;
            *counts.get_mut(least).expect("present") += 1;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Address, MemberUid, UniqueAddress};

    fn region(n: u64) -> RegionId {
        RegionId {
            member: UniqueAddress {
                address: Address(format!("h:{n}").into()),
                uid: MemberUid(n),
            },
            core: 0,
        }
    }

    #[test]
    fn allocates_to_least_loaded_with_deterministic_ties() {
        let mut s = LeastShardAllocationStrategy::default();
        let mut cur = BTreeMap::new();
        cur.insert(region(2), vec![ShardId(1)]);
        cur.insert(region(1), vec![]);
        cur.insert(region(3), vec![]);
        assert_eq!(
            s.allocate_shard(&region(2), ShardId(9), &cur),
            Ok(region(1))
        );
        assert_eq!(
            s.allocate_shard(&region(2), ShardId(9), &BTreeMap::new()),
            Err(StrategyError::NoEligibleRegion)
        );
    }

    #[test]
    fn rebalance_respects_limits_and_converges() {
        let mut s = LeastShardAllocationStrategy::default();
        let mut cur = BTreeMap::new();
        cur.insert(region(1), (0..30).map(ShardId).collect::<Vec<_>>());
        cur.insert(region(2), vec![]);
        // 10% of 30 = 3 shards per round.
        let moved = s.rebalance(&cur, &BTreeSet::new()).unwrap();
        assert_eq!(moved.len(), 3);
        // Nothing while a round is in progress.
        assert!(s.rebalance(&cur, &moved).unwrap().is_empty());
        // Balanced within one: nothing.
        let mut bal = BTreeMap::new();
        bal.insert(region(1), vec![ShardId(0), ShardId(1)]);
        bal.insert(region(2), vec![ShardId(2)]);
        assert!(s.rebalance(&bal, &BTreeSet::new()).unwrap().is_empty());
        // Simulate rounds: converges to a difference of at most 1.
        let mut a: Vec<ShardId> = (0..30).map(ShardId).collect();
        let mut b: Vec<ShardId> = vec![];
        for _round in 0..20 {
            let mut cur = BTreeMap::new();
            cur.insert(region(1), a.clone());
            cur.insert(region(2), b.clone());
            let m = s.rebalance(&cur, &BTreeSet::new()).unwrap();
            for sh in m {
                a.retain(|x| *x != sh);
                b.push(sh);
                b.sort();
            }
        }
        assert!(a.len().abs_diff(b.len()) <= 1);
    }
}
