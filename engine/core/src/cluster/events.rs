//! Cluster events published to subscribers (Akka's `ClusterEvent`).

use std::collections::{BTreeMap, BTreeSet};

use super::member::{Member, MemberStatus};
use crate::ids::UniqueAddress;

/// A snapshot of the membership as published: what a subscriber receives
/// first, before any event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CurrentClusterState {
    /// Current members (not removed), by unique address.
    pub members: BTreeMap<UniqueAddress, Member>,
    /// Members that are unreachable.
    pub unreachable: BTreeSet<UniqueAddress>,
    /// The leader, if any.
    pub leader: Option<UniqueAddress>,
}

impl CurrentClusterState {
    /// Applies one event to the snapshot; folding the initial state with
    /// every later event gives the current state.
    pub fn apply(&mut self, event: &ClusterEvent) {
        match event {
            ClusterEvent::CurrentClusterState(s) => *self = s.clone(),
            ClusterEvent::MemberJoined(m)
            | ClusterEvent::MemberWeaklyUp(m)
            | ClusterEvent::MemberUp(m)
            | ClusterEvent::MemberLeft(m)
            | ClusterEvent::MemberExited(m)
            | ClusterEvent::MemberDowned(m) => {
                self.members.insert(m.unique_address.clone(), m.clone());
            }
            ClusterEvent::MemberRemoved { member, .. } => {
                self.members.remove(&member.unique_address);
                self.unreachable.remove(&member.unique_address);
            }
            ClusterEvent::UnreachableMember(m) => {
                self.unreachable.insert(m.unique_address.clone());
            }
            ClusterEvent::ReachableMember(m) => {
                self.unreachable.remove(&m.unique_address);
            }
            ClusterEvent::LeaderChanged(l) => self.leader = l.clone(),
        }
    }
}

/// A change of the membership as seen by this member.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClusterEvent {
    /// The state at subscription time; always the first event a subscriber
    /// gets.
    CurrentClusterState(CurrentClusterState),
    /// A member is Joining.
    MemberJoined(Member),
    /// A member is WeaklyUp.
    MemberWeaklyUp(Member),
    /// A member is Up.
    MemberUp(Member),
    /// A member is Leaving.
    MemberLeft(Member),
    /// A member is Exiting.
    MemberExited(Member),
    /// A member is Down.
    MemberDowned(Member),
    /// A member was removed.
    MemberRemoved {
        /// The member, with status Removed.
        member: Member,
        /// Its status before removal.
        previous_status: MemberStatus,
    },
    /// A member became unreachable.
    UnreachableMember(Member),
    /// A member is reachable again.
    ReachableMember(Member),
    /// The leader changed.
    LeaderChanged(Option<UniqueAddress>),
}

/// The events that turn `old` into `new` (Akka's
/// `ClusterDomainEventPublisher` diff).
pub fn diff(old: &CurrentClusterState, new: &CurrentClusterState) -> Vec<ClusterEvent> {
    let mut out = Vec::new();
    for (ua, m) in &new.members {
        if old.members.get(ua) != Some(m) {
            out.push(status_event(m));
        }
    }
    for (ua, m) in &old.members {
        if !new.members.contains_key(ua) {
            let mut member = m.clone();
            member.status = MemberStatus::Removed;
            out.push(ClusterEvent::MemberRemoved {
                member,
                previous_status: m.status,
            });
        }
    }
    for ua in new.unreachable.difference(&old.unreachable) {
        if let Some(m) = new.members.get(ua) {
            out.push(ClusterEvent::UnreachableMember(m.clone()));
        }
    }
    for ua in old.unreachable.difference(&new.unreachable) {
        if let Some(m) = new.members.get(ua) {
            out.push(ClusterEvent::ReachableMember(m.clone()));
        }
    }
    if old.leader != new.leader {
        out.push(ClusterEvent::LeaderChanged(new.leader.clone()));
    }
    out
}

/// The event announcing `m`'s current status.
fn status_event(m: &Member) -> ClusterEvent {
    let m = m.clone();
    match m.status {
        MemberStatus::Joining => ClusterEvent::MemberJoined(m),
        MemberStatus::WeaklyUp => ClusterEvent::MemberWeaklyUp(m),
        MemberStatus::Up => ClusterEvent::MemberUp(m),
        MemberStatus::Leaving => ClusterEvent::MemberLeft(m),
        MemberStatus::Exiting => ClusterEvent::MemberExited(m),
        MemberStatus::Down | MemberStatus::Removed => ClusterEvent::MemberDowned(m),
    }
}
