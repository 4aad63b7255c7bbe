//! The messages members exchange, as plain data (see [`super::codec`] for
//! their bytes).

use std::collections::BTreeSet;

use super::gossip::Gossip;
use super::vclock::VectorClock;
use crate::ids::{Address, UniqueAddress};

/// A message between members (Akka's cluster protocol, plus the hand-over
/// of the coordinator singleton). Every message names its sender's
/// incarnation; messages to a member also name the receiver's incarnation so
/// that one meant for an earlier incarnation is ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterMessage {
    /// A starting node asks a seed whether it is a member (Akka `InitJoin`).
    InitJoin {
        /// The starting node.
        from: UniqueAddress,
    },
    /// The seed is a member: the starting node may join it.
    InitJoinAck {
        /// The seed.
        from: UniqueAddress,
    },
    /// The seed is not a member (yet).
    InitJoinNack {
        /// The seed.
        from: UniqueAddress,
    },
    /// Asks to become a member.
    Join {
        /// The joining node.
        from: UniqueAddress,
        /// Its roles.
        roles: BTreeSet<String>,
    },
    /// Accepts a join and carries the membership state.
    Welcome {
        /// The member that accepted the join.
        from: UniqueAddress,
        /// The joining node.
        to: UniqueAddress,
        /// The membership state, including the joiner as Joining.
        gossip: Gossip,
    },
    /// The full membership state.
    Gossip {
        /// Sender.
        from: UniqueAddress,
        /// Receiver.
        to: UniqueAddress,
        /// The sender's membership state.
        gossip: Gossip,
    },
    /// Only the version, sent to a member that has seen it (Akka
    /// `GossipStatus`); the receiver answers with its gossip if it is newer
    /// or with its own status if it is older.
    GossipStatus {
        /// Sender.
        from: UniqueAddress,
        /// Receiver.
        to: UniqueAddress,
        /// The sender's version.
        version: VectorClock,
        /// Members the sender knows to have seen that version (Akka's seen
        /// digest): with equal versions the receiver unites it into its own.
        seen: BTreeSet<UniqueAddress>,
    },
    /// Failure-detector heartbeat.
    Heartbeat {
        /// The monitoring member.
        from: UniqueAddress,
        /// The monitored member.
        to: UniqueAddress,
        /// Increasing per sender.
        sequence_nr: u64,
    },
    /// Answer to a heartbeat.
    HeartbeatRsp {
        /// The monitored member.
        from: UniqueAddress,
        /// The monitoring member.
        to: UniqueAddress,
        /// The heartbeat's sequence number.
        sequence_nr: u64,
    },
    /// Tells `to` that the sender considers it Down or removed: it must stop
    /// at once (the equivalent of Akka's quarantine of a removed member),
    /// whatever status the sender has in its own view.
    Downed {
        /// Sender.
        from: UniqueAddress,
        /// The downed incarnation.
        to: UniqueAddress,
    },
    /// The new oldest member asks for the coordinator singleton
    /// (Akka `HandOverToMe`).
    HandOverToMe {
        /// The new oldest.
        from: UniqueAddress,
        /// A member that may run the singleton.
        to: UniqueAddress,
    },
    /// The sender does not run the singleton (any more) (Akka `HandOverDone`).
    HandOverDone {
        /// Sender.
        from: UniqueAddress,
        /// The new oldest.
        to: UniqueAddress,
    },
}

impl ClusterMessage {
    /// The sender's incarnation.
    pub fn from(&self) -> &UniqueAddress {
        match self {
            ClusterMessage::InitJoin { from }
            | ClusterMessage::InitJoinAck { from }
            | ClusterMessage::InitJoinNack { from }
            | ClusterMessage::Join { from, .. }
            | ClusterMessage::Welcome { from, .. }
            | ClusterMessage::Gossip { from, .. }
            | ClusterMessage::GossipStatus { from, .. }
            | ClusterMessage::Heartbeat { from, .. }
            | ClusterMessage::HeartbeatRsp { from, .. }
            | ClusterMessage::Downed { from, .. }
            | ClusterMessage::HandOverToMe { from, .. }
            | ClusterMessage::HandOverDone { from, .. } => from,
        }
    }
}

/// A message to send: the runtime writes `message` to the member at `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Transmit {
    /// Destination cluster address.
    pub to: Address,
    /// The message.
    pub message: ClusterMessage,
}
