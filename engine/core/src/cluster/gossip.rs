//! The membership state that is gossiped: members, reachability, version,
//! seen set and tombstones, with a merge that is commutative, associative and
//! idempotent (Akka's `Gossip` and `Reachability`).

use std::collections::{BTreeMap, BTreeSet};

use super::member::{Member, MemberStatus};
use super::vclock::VectorClock;
use crate::ids::UniqueAddress;

/// What one observer reports: the subjects it finds unreachable, with the
/// observer's own version of that report (only the observer changes it, and
/// it bumps the version on each change).
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObserverRecord {
    /// The observer's version of this record; a higher version replaces a
    /// lower one on merge.
    pub version: u64,
    /// Subjects this observer's failure detector finds unreachable.
    pub unreachable: BTreeSet<UniqueAddress>,
}

/// Reachability observations of all members (Akka's `Reachability`): a
/// member is unreachable when any (non-downed) observer finds it unreachable,
/// and reachable again once every such observer sees it again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Reachability {
    /// One record per observer.
    pub records: BTreeMap<UniqueAddress, ObserverRecord>,
}

impl Reachability {
    /// Observer `observer` marks `subject` unreachable; returns whether that
    /// changed anything.
    pub fn unreachable(&mut self, observer: &UniqueAddress, subject: &UniqueAddress) -> bool {
        let rec = self.records.entry(observer.clone()).or_default();
        if rec.unreachable.insert(subject.clone()) {
            rec.version += 1;
            true
        } else {
            false
        }
    }

    /// Observer `observer` sees `subject` again; returns whether that changed
    /// anything.
    pub fn reachable(&mut self, observer: &UniqueAddress, subject: &UniqueAddress) -> bool {
        let Some(rec) = self.records.get_mut(observer) else {
            return false;
        };
        if rec.unreachable.remove(subject) {
            rec.version += 1;
            true
        } else {
            false
        }
    }

    /// Whether `observer` currently finds `subject` unreachable.
    pub fn is_unreachable_by(&self, observer: &UniqueAddress, subject: &UniqueAddress) -> bool {
        self.records
            .get(observer)
            .is_some_and(|r| r.unreachable.contains(subject))
    }

    /// Per observer, the record with the higher version wins (equal versions,
    /// which a correct run never produces with different content: the union
    /// of both, so that the merge is a lattice join).
    pub fn merge(&self, other: &Reachability) -> Reachability {
        let mut records = self.records.clone();
        for (obs, rec) in &other.records {
            match records.get_mut(obs) {
                Some(mine) if mine.version > rec.version => {}
                Some(mine) if mine.version == rec.version => {
                    mine.unreachable.extend(rec.unreachable.iter().cloned());
                }
                _ => {
                    records.insert(obs.clone(), rec.clone());
                }
            }
        }
        Reachability { records }
    }

    fn remove_nodes(&mut self, removed: &BTreeSet<UniqueAddress>) {
        self.records.retain(|obs, _| !removed.contains(obs));
        for rec in self.records.values_mut() {
            rec.unreachable.retain(|s| !removed.contains(s));
        }
    }

    /// Observers that find `subject` unreachable.
    pub fn observers_of(&self, subject: &UniqueAddress) -> BTreeSet<UniqueAddress> {
        self.records
            .iter()
            .filter(|(_, r)| r.unreachable.contains(subject))
            .map(|(o, _)| o.clone())
            .collect()
    }
}

/// The gossiped membership state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gossip {
    /// Members by unique address (removed members are not here but in
    /// `tombstones`).
    pub members: BTreeMap<UniqueAddress, Member>,
    /// Failure-detector observations.
    pub reachability: Reachability,
    /// Members that have seen exactly this `version`.
    pub seen: BTreeSet<UniqueAddress>,
    /// The version of this state.
    pub version: VectorClock,
    /// Removed incarnations; they never come back (a restarted node joins
    /// with a new uid).
    pub tombstones: BTreeSet<UniqueAddress>,
}

impl Gossip {
    /// A member by unique address.
    pub fn member(&self, ua: &UniqueAddress) -> Option<&Member> {
        self.members.get(ua)
    }

    /// Members that any non-downed observer finds unreachable.
    pub fn unreachable_members(&self) -> BTreeSet<UniqueAddress> {
        let mut out = BTreeSet::new();
        for (obs, rec) in &self.reachability.records {
            let observer_ok = self
                .members
                .get(obs)
                .is_some_and(|m| m.status != MemberStatus::Down);
            if !observer_ok {
                continue;
            }
            for s in &rec.unreachable {
                if self.members.contains_key(s) {
                    out.insert(s.clone());
                }
            }
        }
        out
    }

    /// Whether `ua` is reachable according to every non-downed observer.
    pub fn is_reachable(&self, ua: &UniqueAddress) -> bool {
        !self.unreachable_members().contains(ua)
    }

    /// The leader as seen from `self_ua`: the first member by address among
    /// the reachable (self counts as reachable) Up or Leaving members; when
    /// there is none, the first reachable Joining or WeaklyUp member
    /// (Akka's `Gossip.leaderOf`).
    pub fn leader(&self, self_ua: &UniqueAddress) -> Option<UniqueAddress> {
        let unreachable = self.unreachable_members();
        let reachable = self
            .members
            .values()
            .filter(|m| &m.unique_address == self_ua || !unreachable.contains(&m.unique_address));
        let mut fallback = None;
        for m in reachable {
            match m.status {
                MemberStatus::Up | MemberStatus::Leaving => return Some(m.unique_address.clone()),
                MemberStatus::Joining | MemberStatus::WeaklyUp if fallback.is_none() => {
                    fallback = Some(m.unique_address.clone());
                }
                _ => {}
            }
        }
        fallback
    }

    /// Convergence (Akka): no member is unreachable unless it is Down or
    /// Exiting, and every Up or Leaving member has seen this version.
    pub fn convergence(&self) -> bool {
        let unreachable = self.unreachable_members();
        let blocked = unreachable.iter().any(|u| {
            self.members
                .get(u)
                .is_some_and(|m| !matches!(m.status, MemberStatus::Down | MemberStatus::Exiting))
        });
        if blocked {
            return false;
        }
        self.members.values().all(|m| {
            !matches!(m.status, MemberStatus::Up | MemberStatus::Leaving)
                || self.seen.contains(&m.unique_address)
        })
    }

    /// Convergence blocked only by unreachable members (used to move Joining
    /// members to WeaklyUp).
    pub fn has_unreachable_blocking(&self) -> bool {
        self.unreachable_members().iter().any(|u| {
            self.members
                .get(u)
                .is_some_and(|m| !matches!(m.status, MemberStatus::Down | MemberStatus::Exiting))
        })
    }

    /// Whether `ua` is a current member or a removed one (tombstone).
    pub fn knows(&self, ua: &UniqueAddress) -> bool {
        self.members.contains_key(ua) || self.tombstones.contains(ua)
    }

    /// Records a change made by `by`: bumps its counter in the version and
    /// resets the seen set to `by` alone.
    pub fn bump(&mut self, by: &UniqueAddress) {
        self.version.increment(by);
        self.seen.clear();
        self.seen.insert(by.clone());
    }

    /// Removes a member: it becomes a tombstone and disappears from the
    /// members, the reachability records and the seen set. Its counter stays
    /// in the version (as long as its tombstone), which keeps merge a lattice
    /// join.
    pub fn remove_member(&mut self, ua: &UniqueAddress) {
        self.tombstones.insert(ua.clone());
        self.normalize();
    }

    /// Drops everything about tombstoned members (idempotent).
    pub fn normalize(&mut self) {
        let t = &self.tombstones;
        self.members.retain(|k, _| !t.contains(k));
        self.seen.retain(|k| !t.contains(k));
        self.reachability.remove_nodes(t);
    }

    /// Merges two gossips (Akka's `Gossip.merge`, made a lattice join):
    /// version = pointwise max; members = union, each the higher-priority
    /// view ([`Member::merge`]); reachability per observer by record
    /// version; tombstones = union, and tombstoned members are dropped
    /// everywhere; seen = the seen sets of the inputs whose version equals
    /// the merged version. Commutative, associative and idempotent (see the
    /// property tests).
    pub fn merge(&self, other: &Gossip) -> Gossip {
        let tombstones: BTreeSet<UniqueAddress> =
            self.tombstones.union(&other.tombstones).cloned().collect();
        let version = self.version.merge(&other.version);
        let mut members = self.members.clone();
        for (k, m) in &other.members {
            let merged = match members.get(k) {
                Some(mine) => mine.merge(m),
                None => m.clone(),
            };
            members.insert(k.clone(), merged);
        }
        let reachability = self.reachability.merge(&other.reachability);
        let mut seen = BTreeSet::new();
        for g in [self, other] {
            if g.version == version {
                seen.extend(g.seen.iter().cloned());
            }
        }
        let mut g = Gossip {
            members,
            reachability,
            seen,
            version,
            tombstones,
        };
        g.normalize();
        g
    }
}
