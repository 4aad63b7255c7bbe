//! Messages between the executors of one node (through rings).

use std::time::Duration;

use shardline_core::cluster::ClusterEvent;
use shardline_core::ids::{EntityId, RegionId, UniqueAddress};
use shardline_core::sharding::{CoordinatorMsg, Envelope, MembershipEvent, RegionMsg};

use super::{EntitySettings, MemberStatusView, RegionStatusView};
use crate::entity::EntityFactory;
use crate::envelope::Status;

/// Who gets the answer to a user message (the `S` of the region's envelopes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyTo {
    /// Nobody (a tell).
    Nobody,
    /// A client connection on this core.
    Client {
        /// The front's connection id.
        conn: u64,
        /// The request's id on that connection (echoed in the answer).
        request_id: u64,
    },
    /// An inbound data-lane connection on this core (a forwarded message).
    Remote {
        /// The inbound lane's connection id.
        conn: u64,
        /// The forwarding core's tag (echoed in the `Reply` frame).
        tag: u64,
    },
    /// Another core of this node, which keeps the original sender under `token`.
    Core {
        /// The forwarding core's index.
        core: u16,
        /// The forwarding core's token for the original sender.
        token: u64,
    },
    /// An embedding-API ask waiting on this core.
    Api {
        /// The ask's id on this core.
        id: u64,
    },
    /// An ask of an entity of this core ([`crate::entity::EntityContext::ask`]):
    /// the answer goes back to it through this core's inbox.
    EntityAsk {
        /// The ask's id on this core.
        id: u64,
    },
    /// Nobody: the envelope is a lifecycle system message for the runtime
    /// of the entity's home (see `node::watch`); a failure to deliver it
    /// is handled by the watch book.
    System(Box<super::watch::SystemMsg>),
}

pub(crate) use crate::api::ApiAnswer;

/// Where an embedding-API ask is answered.
pub(crate) struct ApiReply {
    /// Completed once, from the data core's thread.
    pub tx: crate::api::oneshot::Sender<ApiAnswer>,
    /// How long the core keeps the ask before it answers `None`.
    pub wait: Duration,
}

/// A user message: payload bytes and who to answer. The payload is a
/// [`bytes::Bytes`]: a request's payload is a view of the bytes its
/// connection received (not copied) until its entity handled it, and a
/// forward to another core or node passes the same bytes on.
pub type UserEnvelope = Envelope<bytes::Bytes, ReplyTo>;

/// The cluster part of a status answer.
#[derive(Debug, Clone)]
pub struct ClusterView {
    /// Every member this one knows, by address.
    pub members: Vec<MemberStatusView>,
    /// The cluster leader's address (`host:port`), if any.
    pub leader: Option<String>,
    /// The address of the member where the coordinators run (the oldest Up).
    pub coordinator: Option<String>,
    /// Whether the coordinators run on this member.
    pub coordinator_here: bool,
    /// The coordinators hosted here, one per entity type.
    pub coordinators: Vec<crate::status::CoordinatorStatusView>,
    /// The cluster's name (filled in by the driver).
    pub cluster_name: String,
    /// The cluster's id, once known (filled in by the driver).
    pub cluster_id: Option<String>,
    /// The coordinator journal's identity (filled in by the driver).
    pub journal_identity: String,
}

/// What the control executor reports to a `ToControl::ShardingStats` request.
#[derive(Debug)]
pub enum StatsEvent {
    /// Sent first: the other Up members asked, and those not asked because
    /// they are unreachable, as (address, uid).
    Asked {
        /// The members asked, as (address, uid).
        asked: Vec<(String, u64)>,
        /// The Up members not asked because they are unreachable.
        unreachable: Vec<(String, u64)>,
    },
    /// One asked member's answer.
    Answer(crate::status::MemberShardStats),
}

/// To a data executor.
pub(crate) enum ToCore {
    /// Start a region (factory `None`: a proxy).
    RegisterType {
        type_name: String,
        factory: Option<EntityFactory>,
        settings: EntitySettings,
    },
    /// A control message for this core's region of `type_name`.
    Region { type_name: String, msg: RegionMsg },
    /// A membership change for every region.
    Membership(MembershipEvent),
    /// The coordinator moved: re-register.
    CoordinatorMoved,
    /// This member may (or may no longer) serve.
    Available(bool),
    /// Start the graceful hand-off of every region.
    GracefulShutdown,
    /// An accepted, handshaken data-lane connection for this core.
    InboundData { fd: i32, peer: UniqueAddress },
    /// Status of this core's regions.
    Status {
        reply: crossbeam_channel::Sender<Vec<RegionStatusView>>,
    },
    /// An embedding-API message. Its ask deadline is `timeout` from its
    /// arrival, at most `requests.ask_timeout_ms` (that when `None`).
    Ask {
        type_name: std::sync::Arc<str>,
        entity: EntityId,
        payload: Vec<u8>,
        timeout: Option<Duration>,
        reply: Option<ApiReply>,
    },
    /// The answer to an ask of an entity of this core
    /// ([`ReplyTo::EntityAsk`]), delivered from the inbox so that the
    /// asker's handler never runs inside another's.
    AskReply {
        id: u64,
        status: Status,
        payload: Vec<u8>,
    },
    /// A user message forwarded by another core of this node.
    Forwarded {
        type_name: compact_str::CompactString,
        envelope: UserEnvelope,
    },
    /// The answer to a message this core forwarded to another core.
    LocalReply {
        token: u64,
        status: Status,
        payload: Vec<u8>,
    },
    /// The member was downed or left: stop serving.
    Stop,
    /// Stop the executor.
    Shutdown,
}

/// To the control executor.
pub enum ToControl {
    /// A region's message for its type's coordinator.
    ToCoordinator {
        /// The entity type.
        type_name: String,
        /// The message.
        msg: CoordinatorMsg,
    },
    /// A region's control message for another region.
    ToRegion {
        /// The entity type.
        type_name: String,
        /// The region it is for.
        to: RegionId,
        /// The message.
        msg: RegionMsg,
    },
    /// An entity type was started (the coordinator must know it).
    RegisterType {
        /// The entity type.
        type_name: String,
        /// The type remembers its entities: its coordinator allocates
        /// shards that lost their home again at once.
        remember_entities: bool,
    },
    /// A core's journal did not open (its durable entities fail until the
    /// node restarts): the node is not ready, as `/health/ready` says.
    JournalFailed {
        /// The core's index.
        core: u16,
    },
    /// A core's regions' registration state changed.
    Registered {
        /// The core's index.
        core: u16,
        /// Whether every region of the core is registered.
        all: bool,
        /// Whether every region knows every shard's home (always true
        /// without warm allocation).
        warm: bool,
    },
    /// A core finished its graceful hand-off.
    ShutdownComplete {
        /// The core's index.
        core: u16,
    },
    /// Cluster part of a status request.
    Status {
        /// Where the answer goes.
        reply: crossbeam_channel::Sender<ClusterView>,
    },
    /// Cluster-wide sharding stats of `type_name`: ask every other Up
    /// member; report on `reply` ([`StatsEvent`]) for `wait`.
    ShardingStats {
        /// The entity type.
        type_name: String,
        /// How long the answers are waited for.
        wait: Duration,
        /// Where the answers go.
        reply: crossbeam_channel::Sender<StatsEvent>,
    },
    /// A coordinator admin command (the allocation table, a rebalance
    /// round), answered here when the coordinators run here, else forwarded
    /// to the oldest member; one answer on `reply`.
    CoordinatorAdmin {
        /// The command.
        cmd: super::admin::CoordinatorCommand,
        /// Where the answer goes.
        reply: crossbeam_channel::Sender<super::admin::AdminAnswer>,
    },
    /// A new subscriber was added to the shared list.
    Subscribe,
    /// Leave gracefully.
    Leave {
        /// How long the leave may take.
        timeout: Duration,
        /// Told once the leave is over.
        done: crossbeam_channel::Sender<()>,
    },
    /// Stop the executor.
    Shutdown,
}

/// Maps a membership event to the sharding state machines' view.
///
/// A Downed member is Leaving for sharding: it gets no new shards and keeps
/// the ones it has until it is removed, when its regions are terminated and
/// their shards allocated again (Akka: the coordinator ranks regions of
/// members that are not Up last, and terminates a region once its member
/// is removed).
pub(crate) fn sharding_event(e: &ClusterEvent) -> Option<MembershipEvent> {
    use shardline_core::cluster::ClusterEvent as E;
    match e {
        E::MemberUp(m) => Some(MembershipEvent::MemberUp(m.unique_address.clone())),
        E::MemberLeft(m) | E::MemberExited(m) | E::MemberDowned(m) => {
            Some(MembershipEvent::MemberLeaving(m.unique_address.clone()))
        }
        E::MemberRemoved { member, .. } => Some(MembershipEvent::MemberRemoved(
            member.unique_address.clone(),
        )),
        _ => None,
    }
}
