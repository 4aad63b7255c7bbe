//! Cluster sharding as sans-IO state machines, after Akka Cluster Sharding
//! (<https://doc.akka.io/docs/akka/current/typed/cluster-sharding.html> and
//! its "Cluster Sharding concepts" page).
//!
//! ```text
//!            GetShardHome / Register / BeginHandOffAck / ShardStopped
//!   +-------------+  ------------------------------------------->  +------------------+
//!   | ShardRegion |                                                 | ShardCoordinator |
//!   | (one / core)|  <-------------------------------------------   | (control core of |
//!   +-------------+   RegisterAck / ShardHome / BeginHandOff /      |  oldest member)  |
//!     |   ^   |        HandOff                                      +------------------+
//!     |   |   '-- Forward(envelope) to the home region                    |
//!     |   '------ handle_message(envelope) from the gateway               '-- Persist(CoordinatorEvent)
//!     '---------- Deliver / StopEntity / StartEntity to local entities
//! ```
//!
//! # Threading model
//! None: every type here is a plain value. The runtime owns one
//! [`ShardRegion`] per data core and one [`ShardCoordinator`] on the control
//! core of the oldest member; it calls `handle_*(now, ..)` with the time
//! elapsed since its origin, then drains effects with `poll_effect()` until
//! `None`, carrying each out **in order** (a `Persist` must be durable before
//! the effects after it are carried out), and calls `handle_timeout(now)` when
//! `poll_timeout()` passes.
//!
//! # Invariants (checked by the simulation in `tests/`)
//! - A shard has at most one home; a home is only given a new owner after the
//!   old owner stopped every entity of the shard (`ShardStopped`) or its region
//!   was terminated.
//! - Every allocation carries a [`Generation`]; inputs that carry an older
//!   generation than the one already known change nothing.
//! - Messages are never pushed into a shard that is stopping: they are
//!   buffered and forwarded once the new home is known.
//! - Each entity's stop message is queued after the messages already queued
//!   for it; messages that reached the old home before its `HandOff` are
//!   processed there, never sent on to the new home.
//! - Per (sender's region, entity), messages are processed in the order the
//!   region received them, through hand-offs and passivation (the rule is
//!   in the module doc of `sharding/region.rs`, "Ordering").
//! - Every buffer is bounded; a message that does not fit is handed back to
//!   its sender as a [`RegionEffect::Fail`] with [`FailureReason::BufferFull`].

mod coordinator;
mod extractor;
mod passivation;
mod region;
mod strategy;

pub use coordinator::{
    AbandonedHandOff, CoordinatorEffect, CoordinatorEvent, CoordinatorSettings, CoordinatorState,
    HandOffPhase, HandOffView, RebalanceRound, RebalanceStart, ShardAllocation, ShardCoordinator,
    HANDOFF_RESEND_INTERVAL, STILL_STOPPING_WAIT_TIMEOUTS, WARM_HOMES_PER_MESSAGE,
};
pub use extractor::{
    shard_id_of, HashCodeExtractor, MessageExtractor, ShardingEnvelope, SHARD_ID_HASH_NAME,
};
pub use passivation::{LruPolicy, PassivationSettings, ReplacementPolicy};
pub use region::{
    ClusterShardingStats, RegionEffect, RegionSettings, RememberEntitiesPace, ShardEvent,
    ShardRegion, ShardRegionState, ShardRegionStats, StopReason,
};
pub use strategy::{LeastShardAllocationStrategy, ShardAllocationStrategy, StrategyError};

use std::fmt;

use crate::ids::{EntityId, RegionId, ShardId, UniqueAddress};

/// The generation of a shard allocation: every `ShardHomeAllocated` event
/// carries a number larger than every generation before it (in the whole
/// coordinator, across failovers, since it is part of the recovered state).
/// Inputs carrying an older generation than the one a state machine already
/// knows are ignored ("Lessons from the field" in `DESIGN.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Generation(pub u64);

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// A user message on its way to an entity: the payload `M` is opaque (never
/// decoded or copied by the state machines), `S` is the opaque token the
/// runtime uses to answer the sender (a connection and request id, say).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope<M, S> {
    /// The target entity.
    pub entity: EntityId,
    /// The entity's shard, from the [`MessageExtractor`].
    pub shard: ShardId,
    /// Who to answer (or to tell about a failure).
    pub sender: S,
    /// The message itself.
    pub payload: M,
    /// When the sender stops waiting for an answer (the ask deadline, on
    /// the same clock as the `now` the state machines are fed); `None`: no
    /// deadline. A message still buffered or not yet routed when its
    /// deadline passes is handed back with
    /// [`FailureReason::DeadlinePassed`] instead of being delivered later
    /// to a sender that gave up on it.
    pub deadline: Option<std::time::Duration>,
}

/// Messages a region sends to the coordinator (Akka's `ShardCoordinator`
/// protocol).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordinatorMsg {
    /// A region that hosts shards announces itself, with the shards it hosts
    /// now (empty on a fresh start; after a coordinator moved, the new one
    /// reconciles this list with what it recovered). Answered by
    /// [`RegionMsg::RegisterAck`].
    Register {
        /// The region.
        region: RegionId,
        /// The shards the region hosts (running or stopping), with their generation.
        hosted: Vec<(ShardId, Generation)>,
        /// The hosted shards that are handing off: the region got their
        /// `HandOff` and is stopping their entities (a subset of `hosted`).
        /// A coordinator that took over during such a hand-off resumes it
        /// (waits for the owner's `ShardStopped`, answers no `GetShardHome`
        /// for the shard meanwhile) instead of naming the stopping owner as
        /// the shard's home; see "Ordering" in `sharding/region.rs`.
        stopping: Vec<ShardId>,
    },
    /// A proxy (routes, hosts nothing) announces itself.
    RegisterProxy {
        /// The proxy region.
        proxy: RegionId,
    },
    /// Where does this shard live? Answered by [`RegionMsg::ShardHome`] once
    /// the shard has a home (possibly after an allocation or a hand-off).
    GetShardHome {
        /// The asking region.
        region: RegionId,
        /// The shard.
        shard: ShardId,
    },
    /// The region stopped routing to the shard and buffers its messages.
    /// Non-owner regions send this through the owner region (see
    /// [`RegionMsg::BeginHandOffAck`]) so that the owner has received every
    /// message they forwarded before it is told to hand off.
    BeginHandOffAck {
        /// The shard.
        shard: ShardId,
        /// The generation from the `BeginHandOff`.
        generation: Generation,
        /// The acknowledging region.
        region: RegionId,
    },
    /// The owner stopped every entity of the shard after a `HandOff`.
    ShardStopped {
        /// The shard.
        shard: ShardId,
        /// The generation the owner hosted.
        generation: Generation,
        /// The owner.
        region: RegionId,
    },
    /// The region is leaving: hand off all its shards (Akka's
    /// `GracefulShutdownReq`).
    GracefulShutdownReq {
        /// The leaving region.
        region: RegionId,
    },
}

/// Control messages a region receives (from the coordinator, or relayed
/// acknowledgements from other regions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionMsg {
    /// The coordinator accepted the region's `Register`/`RegisterProxy`.
    RegisterAck,
    /// The home of a shard at a generation.
    ShardHome {
        /// The shard.
        shard: ShardId,
        /// Its home region.
        region: RegionId,
        /// The allocation's generation.
        generation: Generation,
    },
    /// Several homes at once (sent after a registration).
    ShardHomes {
        /// (shard, home, generation) triples.
        homes: Vec<(ShardId, RegionId, Generation)>,
    },
    /// The shard is about to move: stop routing to it and buffer its messages;
    /// acknowledge through the owner.
    BeginHandOff {
        /// The shard.
        shard: ShardId,
        /// The allocation's generation.
        generation: Generation,
        /// The current owner.
        owner: RegionId,
    },
    /// To the owner: stop the shard's entities, then send `ShardStopped`.
    HandOff {
        /// The shard.
        shard: ShardId,
        /// The allocation's generation.
        generation: Generation,
    },
    /// `StartEntity`: start the entity at this region, which is (or becomes)
    /// its shard's home.
    StartEntity {
        /// The shard.
        shard: ShardId,
        /// The entity.
        entity: EntityId,
    },
    /// A `BeginHandOffAck` from another region that the receiving owner relays
    /// to the coordinator (after every message that region forwarded to it).
    BeginHandOffAck {
        /// The shard.
        shard: ShardId,
        /// The generation from the `BeginHandOff`.
        generation: Generation,
        /// The acknowledging region.
        region: RegionId,
    },
}

/// A member's status as far as sharding cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberStatus {
    /// Up: may host new shards.
    Up,
    /// Leaving (or exiting): alive, but no new shard goes there.
    Leaving,
}

/// Membership input for the coordinator and the regions. The cluster module
/// (or the simulation's script) produces these.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MembershipEvent {
    /// The whole current view: every member that is alive, with its status.
    /// Regions of members not listed are treated as terminated.
    CurrentMembers(Vec<(UniqueAddress, MemberStatus)>),
    /// A member became Up.
    MemberUp(UniqueAddress),
    /// A member started leaving: it keeps its shards until they are handed
    /// off, but gets no new ones.
    MemberLeaving(UniqueAddress),
    /// A member was removed (left, or downed after a crash): all its regions
    /// are terminated.
    MemberRemoved(UniqueAddress),
    /// One region stopped (its member may live on).
    RegionTerminated(RegionId),
}

/// Why a message was handed back to its sender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailureReason {
    /// The region's buffer (`buffer_size` messages) was full.
    BufferFull,
    /// The region is shutting down and routes nothing more.
    ShuttingDown,
    /// The region is a proxy and got a message for a shard homed at itself
    /// (a coordinator inconsistency).
    NotHosted,
    /// The message's [`Envelope::deadline`] passed before it could be
    /// delivered (it waited in a buffer for a shard home, a hand-off or a
    /// recovery).
    DeadlinePassed,
}

impl FailureReason {
    /// Every reason, in a fixed order (the index of
    /// [`ShardRegion::dead_letters_by_reason`]).
    pub const ALL: [FailureReason; 4] = [
        FailureReason::BufferFull,
        FailureReason::ShuttingDown,
        FailureReason::NotHosted,
        FailureReason::DeadlinePassed,
    ];

    /// A short snake_case name, used as the `reason` label of the
    /// `shardline_dead_letters_total` metric and in the node status.
    pub fn label(&self) -> &'static str {
        match self {
            FailureReason::BufferFull => "buffer_full",
            FailureReason::ShuttingDown => "shutting_down",
            FailureReason::NotHosted => "not_hosted",
            FailureReason::DeadlinePassed => "deadline_passed",
        }
    }

    fn index(&self) -> usize {
        match self {
            FailureReason::BufferFull => 0,
            FailureReason::ShuttingDown => 1,
            FailureReason::NotHosted => 2,
            FailureReason::DeadlinePassed => 3,
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FailureReason::BufferFull => "buffer full",
            FailureReason::ShuttingDown => "region shutting down",
            FailureReason::NotHosted => "proxy cannot host",
            FailureReason::DeadlinePassed => "ask deadline passed while buffered; not delivered",
        })
    }
}

/// `(shard, entity)`: an entity's key within a region.
pub type EntityKey = (ShardId, EntityId);
