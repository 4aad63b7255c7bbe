//! Hash maps whose iteration order is fixed.
//!
//! `std`'s `HashMap` seeds its hasher randomly per map, so iterating one
//! yields a different order in every process. Wherever a state machine in
//! this crate iterates a map to produce effects, that order would leak into
//! the effects and a seeded simulation run would not replay exactly. The
//! maps here hash with foldhash's [`FixedState`] (one fixed seed): the same
//! sequence of inserts and removals gives the same iteration order in every
//! run. foldhash, not `std`'s SipHash-1-3: a region's shard table is looked
//! up on every message (by the region and by the entity host, two lookups
//! of a shard id and two of an entity id per delivery), and foldhash hashes
//! a short id several times faster.
//!
//! These maps are keyed by ids the cluster chooses (shard ids, entity ids
//! from clients); a fixed seed makes hash flooding possible in principle by
//! a client choosing colliding entity ids (with SipHash under fixed zero
//! keys, as before, just the same: a known key protects nothing). The
//! table's probing bounds the cost of a collision chain, entity ids are
//! spread over shards (one table each) by a separate hash, and the ids'
//! routing already limits what a single client reaches.

use std::collections::{HashMap, HashSet};

pub use foldhash::fast::FixedState;

/// The fixed-seed hasher builder of [`DetHashMap`] and [`DetHashSet`].
pub type DetState = FixedState;

/// A `HashMap` with a fixed hasher seed: deterministic iteration order for
/// a given sequence of operations.
pub type DetHashMap<K, V> = HashMap<K, V, DetState>;

/// A `HashSet` with a fixed hasher seed (see [`DetHashMap`]).
pub type DetHashSet<T> = HashSet<T, DetState>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iteration_order_is_the_same_for_the_same_operations() {
        let build = || {
            let mut m: DetHashMap<u64, u64> = DetHashMap::default();
            for i in 0..1000u64 {
                m.insert(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), i);
            }
            for i in (0..1000u64).step_by(3) {
                m.remove(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            }
            m.into_iter().collect::<Vec<_>>()
        };
        let a = build();
        assert_eq!(a, build());
        // And not simply sorted: the order is the hash table's.
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_ne!(a, sorted);
    }
}
