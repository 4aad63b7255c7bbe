//! Members and their lifecycle statuses.

use std::collections::BTreeSet;

use crate::ids::UniqueAddress;

/// The lifecycle status of a member (Akka Cluster's `MemberStatus`).
///
/// The discriminants are the merge priority: when two gossips disagree about
/// a member's status, the higher value wins (Akka's
/// `Member.highestPriorityOf`: Removed > Down > Exiting > Leaving > Up >
/// WeaklyUp > Joining). Every legal transition goes to a higher value, so the
/// status is a join-semilattice and gossip merge stays commutative.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum MemberStatus {
    /// Accepted by a member, not yet moved up by the leader.
    Joining = 0,
    /// Moved up while convergence is blocked by an unreachable member
    /// (`allow_weakly_up_members`); becomes Up at the next convergence.
    WeaklyUp = 1,
    /// A full member: may host shards and the coordinator.
    Up = 2,
    /// Asked to leave gracefully; its shards are handed off.
    Leaving = 3,
    /// Moved by the leader from Leaving; the member stops.
    Exiting = 4,
    /// Marked down (by the downing provider or an operator); it must stop.
    Down = 5,
    /// Removed by the leader; only a tombstone remains.
    Removed = 6,
}

impl MemberStatus {
    /// Whether Akka's lifecycle allows moving from `self` to `to`.
    ///
    /// Joining → WeaklyUp | Up | Leaving | Down | Removed; WeaklyUp → Up |
    /// Leaving | Down | Removed; Up → Leaving | Down | Removed; Leaving →
    /// Exiting | Down | Removed; Exiting → Removed | Down; Down → Removed.
    pub fn can_transition_to(self, to: MemberStatus) -> bool {
        use MemberStatus::*;
        matches!(
            (self, to),
            (Joining, WeaklyUp | Up | Leaving | Down | Removed)
                | (WeaklyUp, Up | Leaving | Down | Removed)
                | (Up, Leaving | Down | Removed)
                | (Leaving, Exiting | Down | Removed)
                | (Exiting, Removed | Down)
                | (Down, Removed)
        )
    }

    /// The wire code of the status (its discriminant).
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The status for a wire code, `None` for an unknown code.
    pub fn from_code(code: u8) -> Option<Self> {
        use MemberStatus::*;
        Some(match code {
            0 => Joining,
            1 => WeaklyUp,
            2 => Up,
            3 => Leaving,
            4 => Exiting,
            5 => Down,
            6 => Removed,
            _ => return None,
        })
    }
}

/// A member of the cluster: one incarnation of a node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Member {
    /// Address and incarnation uid.
    pub unique_address: UniqueAddress,
    /// Lifecycle status.
    pub status: MemberStatus,
    /// Roles given in the member's configuration (fixed per incarnation).
    pub roles: BTreeSet<String>,
    /// The member's age: assigned by the leader when it moves the member to
    /// Up (1 for the first member, then one more than the youngest). Lower is
    /// older; 0 means "never was Up".
    pub up_number: u32,
}

impl Member {
    /// A new member in status Joining.
    pub fn joining(unique_address: UniqueAddress, roles: BTreeSet<String>) -> Self {
        Self {
            unique_address,
            status: MemberStatus::Joining,
            roles,
            up_number: 0,
        }
    }

    /// Whether the member has `role` (`None` matches every member).
    pub fn has_role(&self, role: Option<&str>) -> bool {
        role.is_none_or(|r| self.roles.contains(r))
    }

    /// Whether `self` is older than `other`: lower up-number, ties broken by
    /// the lower address (Akka's `Member.isOlderThan`, with the address as
    /// tie-break so that every node agrees).
    pub fn is_older_than(&self, other: &Member) -> bool {
        let a = (self.age_key(), &self.unique_address);
        let b = (other.age_key(), &other.unique_address);
        a < b
    }

    fn age_key(&self) -> u32 {
        if self.up_number == 0 {
            u32::MAX
        } else {
            self.up_number
        }
    }

    /// The merge of two views of the same member (same unique address): the
    /// higher-priority status wins; with the same status the older
    /// up-number wins; roles are united (they never differ for one
    /// incarnation). Commutative, associative and idempotent.
    pub fn merge(&self, other: &Member) -> Member {
        debug_assert_eq!(self.unique_address, other.unique_address);
        let (status, up_number) = match self.status.cmp(&other.status) {
            std::cmp::Ordering::Greater => (self.status, self.up_number),
            std::cmp::Ordering::Less => (other.status, other.up_number),
            std::cmp::Ordering::Equal => {
                let up = if self.age_key() <= other.age_key() {
                    self.up_number
                } else {
                    other.up_number
                };
                (self.status, up)
            }
        };
        Member {
            unique_address: self.unique_address.clone(),
            status,
            roles: self.roles.union(&other.roles).cloned().collect(),
            up_number,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MemberStatus::*;

    #[test]
    fn transitions_only_go_up_in_priority() {
        let all = [Joining, WeaklyUp, Up, Leaving, Exiting, Down, Removed];
        for a in all {
            for b in all {
                if a.can_transition_to(b) {
                    assert!(b > a, "{a:?} -> {b:?}");
                }
            }
            assert_eq!(MemberStatus::from_code(a.code()), Some(a));
        }
        assert!(!Up.can_transition_to(Joining));
        assert!(!Removed.can_transition_to(Up));
        assert!(Leaving.can_transition_to(Exiting));
        assert!(!Up.can_transition_to(Exiting));
        assert_eq!(MemberStatus::from_code(7), None);
    }
}
