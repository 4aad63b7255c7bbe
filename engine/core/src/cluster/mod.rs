//! Cluster membership as sans-IO state machines, after Akka Cluster
//! (<https://doc.akka.io/docs/akka/current/typed/cluster-membership.html>,
//! <https://doc.akka.io/docs/akka/current/typed/cluster-concepts.html>).
//!
//! ```text
//!            join (seed / Join + Welcome)
//!                     │
//!                     ▼
//!                ┌─────────┐  leader, no convergence     ┌──────────┐
//!                │ Joining │ ───────────────────────────▶│ WeaklyUp │
//!                └─────────┘  (unreachable blocks it)    └──────────┘
//!                     │ leader, at convergence                │ leader, at convergence
//!                     ▼                                       │
//!                ┌─────────┐◀─────────────────────────────────┘
//!                │   Up    │
//!                └─────────┘
//!                     │ leave()
//!                     ▼
//!                ┌─────────┐  leader, at convergence   ┌─────────┐  leader   ┌─────────┐
//!                │ Leaving │ ─────────────────────────▶│ Exiting │ ─────────▶│ Removed │
//!                └─────────┘                           └─────────┘           └─────────┘
//!                                                                                 ▲
//!   any of Joining, WeaklyUp, Up, Leaving, Exiting ──down──▶ ┌──────┐  leader     │
//!   (downing provider, operator, newer incarnation)          │ Down │─────────────┘
//!                                                            └──────┘  at convergence,
//!                                                                      after down_removal_margin
//! ```
//!
//! Pieces (each a plain state machine; [`ClusterNode`] ties them together):
//! * [`member`]: [`Member`] and [`MemberStatus`] with Akka's transitions;
//! * [`vclock`] and [`gossip`]: the versioned membership state and its merge,
//!   a lattice join (commutative, associative, idempotent: property-tested);
//! * [`phi`]: the [`PhiAccrualFailureDetector`] (Hayashibara et al. 2004);
//! * [`downing`]: the pluggable [`DowningProvider`] and the
//!   [`SplitBrainResolver`] (keep-majority, static-quorum, keep-oldest,
//!   down-all, down-all-when-unstable; indirectly connected members downed);
//! * [`events`]: [`ClusterEvent`]s and the subscriber's initial state;
//! * [`message`] and [`codec`]: the messages between members and their
//!   versioned binary form.
//!
//! Rules this module enforces (Akka's):
//! * Only the first seed may form a new cluster, and only after no other seed
//!   answered for `seed_node_timeout` (5 s), or every other seed answered
//!   that it is not a member, so a restart never forms an island.
//! * The leader is the first reachable Up/Leaving member by address; it
//!   moves members only at convergence (every reachable Up/Leaving member has
//!   seen the version, nobody unreachable except Down/Exiting ones).
//! * Each member is monitored by up to `monitored_by_nr_of_members` (5)
//!   members, the next ones on the ring of members sorted by address.
//! * A member whose cluster port refused `refusals_to_down` connections in a
//!   row (reported by the shell: `ClusterNode::handle_connection_refused`)
//!   is taken as a process that is gone: the downing provider may down it at
//!   once (`DowningProvider::decide_refused`; the resolver does when its
//!   strategy keeps this side and nothing else is unreachable), and the
//!   leader removes it at convergence without `down_removal_margin`; so is
//!   an incarnation replaced by a newer one at its address. Unreachability
//!   by timeouts keeps the resolver's rules and `stable_after`.
//! * The first seed forms a new cluster at once when every other seed
//!   answered `InitJoinNack` (none is a member of any cluster).
//! * A member that learns it is Down (from gossip, a `Downed` reply, or its
//!   own resolver's decision) stops at once ([`StopReason::Downed`]); a
//!   `Downed` reply counts even from a member this one holds Down or
//!   removed (two members that downed each other both stop). A node
//!   that notices a gap of more than `pause_fence_after` between two inputs
//!   was paused: it stops serving until a member answers a fresh heartbeat.
//! * The coordinator singleton runs on the oldest Up member (optionally of a
//!   role) and starts only after every other member confirmed that it does
//!   not run it (`HandOverDone`) or was removed, so the old one has stopped
//!   before the new one starts.

pub mod codec;
pub mod downing;
pub mod events;
pub mod gossip;
pub mod member;
pub mod message;
mod node;
pub mod phi;
pub mod vclock;

pub use codec::{decode, encode, DecodeError, WIRE_VERSION};
pub use downing::{
    DecisionReason, DowningDecision, DowningProvider, DowningView, NoDowning, SbrConfig,
    SbrStrategy, SplitBrainResolver,
};
pub use events::{ClusterEvent, CurrentClusterState};
pub use gossip::{Gossip, ObserverRecord, Reachability};
pub use member::{Member, MemberStatus};
pub use message::{ClusterMessage, Transmit};
pub use node::{ClusterConfig, ClusterNode, DowningConfig, SingletonCommand, StopReason};
pub use phi::{PhiAccrualFailureDetector, PhiConfig};
pub use vclock::{ClockOrdering, VectorClock};

#[cfg(test)]
mod tests;
