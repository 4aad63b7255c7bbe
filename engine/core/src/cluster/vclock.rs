//! Vector clocks: the version of the membership state.
//!
//! One counter per member that changed the state (Lamport 1978; Akka's
//! `VectorClock`, keyed here by the member's unique address instead of a
//! hash of it).

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use crate::ids::UniqueAddress;

/// How two vector clocks relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockOrdering {
    /// Equal clocks.
    Same,
    /// The left clock happened before the right one.
    Before,
    /// The left clock happened after the right one.
    After,
    /// Neither happened before the other.
    Concurrent,
}

/// A vector clock: a counter per member (missing entries count as zero).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct VectorClock {
    entries: BTreeMap<UniqueAddress, u64>,
}

impl VectorClock {
    /// The empty clock (all counters zero).
    pub fn new() -> Self {
        Self::default()
    }

    /// Increments the counter of `node`.
    pub fn increment(&mut self, node: &UniqueAddress) {
        *self.entries.entry(node.clone()).or_insert(0) += 1;
    }

    /// The counter of `node` (0 when absent).
    pub fn get(&self, node: &UniqueAddress) -> u64 {
        self.entries.get(node).copied().unwrap_or(0)
    }

    /// Sets the counter of `node`; a zero removes the entry.
    pub fn set(&mut self, node: UniqueAddress, counter: u64) {
        if counter == 0 {
            self.entries.remove(&node);
        } else {
            self.entries.insert(node, counter);
        }
    }

    /// The entries, ordered by unique address.
    pub fn entries(&self) -> impl Iterator<Item = (&UniqueAddress, u64)> {
        self.entries.iter().map(|(k, v)| (k, *v))
    }

    /// Number of non-zero entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether every counter is zero.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The pointwise maximum of two clocks (the least upper bound).
    pub fn merge(&self, other: &VectorClock) -> VectorClock {
        let mut entries = self.entries.clone();
        for (k, v) in &other.entries {
            let e = entries.entry(k.clone()).or_insert(0);
            *e = (*e).max(*v);
        }
        VectorClock { entries }
    }

    /// Compares two clocks.
    pub fn compare(&self, other: &VectorClock) -> ClockOrdering {
        let mut less = false;
        let mut greater = false;
        let keys: BTreeSet<&UniqueAddress> =
            self.entries.keys().chain(other.entries.keys()).collect();
        for k in keys {
            match self.get(k).cmp(&other.get(k)) {
                Ordering::Less => less = true,
                Ordering::Greater => greater = true,
                Ordering::Equal => {}
            }
        }
        match (less, greater) {
            (false, false) => ClockOrdering::Same,
            (true, false) => ClockOrdering::Before,
            (false, true) => ClockOrdering::After,
            (true, true) => ClockOrdering::Concurrent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Address, MemberUid};

    fn ua(n: u64) -> UniqueAddress {
        UniqueAddress {
            address: Address(format!("10.0.0.{n}:7000").into()),
            uid: MemberUid(n),
        }
    }

    #[test]
    fn ordering() {
        let mut a = VectorClock::new();
        let b = a.clone();
        assert_eq!(a.compare(&b), ClockOrdering::Same);
        a.increment(&ua(1));
        assert_eq!(a.compare(&b), ClockOrdering::After);
        assert_eq!(b.compare(&a), ClockOrdering::Before);
        let mut c = b.clone();
        c.increment(&ua(2));
        assert_eq!(a.compare(&c), ClockOrdering::Concurrent);
        let m = a.merge(&c);
        assert_eq!(m.compare(&a), ClockOrdering::After);
        assert_eq!(m.compare(&c), ClockOrdering::After);
        assert_eq!(m.get(&ua(1)), 1);
        assert_eq!(m.get(&ua(2)), 1);
    }
}
