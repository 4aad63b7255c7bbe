//! Node-to-node wire types: the handshake, control frames (membership gossip,
//! coordinator and region messages) and data frames (forwarded user messages
//! and their replies).
//!
//! Membership messages travel as the bytes of `shardline_core::cluster::encode`
//! inside [`ControlFrame::Cluster`]; sharding messages are mirrored here as
//! rkyv types ([`WireCoordinatorMsg`], [`WireRegionMsg`]).

use rkyv::{Archive, Deserialize, Serialize};
use shardline_core::ids::{Address, EntityId, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{CoordinatorEvent, CoordinatorMsg, Generation, RegionMsg};

use super::FrameError;

/// Which lane a node-to-node connection carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Lane {
    /// Heartbeats, gossip, coordinator and region control messages.
    Control = 0,
    /// Forwarded user messages for one data core (`Hello::target_core`).
    Data = 1,
}

/// The first frame on every node-to-node connection, from the connecting side.
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub struct Hello {
    /// [`super::PROTOCOL_VERSION`] of the sender.
    pub protocol_version: u32,
    /// The sender's cluster address.
    pub address: String,
    /// The sender's incarnation uid.
    pub uid: u64,
    /// [`Lane`] as u8.
    pub lane: u8,
    /// For a data lane: the receiver's data core the connection is for.
    pub target_core: u16,
    /// The shard hash's name (`SHARD_ID_HASH_NAME`).
    pub hash_name: String,
    /// The sender's `number_of_shards`.
    pub number_of_shards: u32,
    /// The sender's `cluster_name`; members of another name are refused.
    pub cluster_name: String,
    /// The sender's cluster id (see `persistence::identity`); empty while
    /// the sender has not learned it.
    pub cluster_id: String,
    /// Where the sender's durable state lives: `local:<data root id>` for
    /// the local journal. Two members can read each other's journals only
    /// when theirs are equal.
    pub journal_identity: String,
    /// Whether the sender hosts durable entity types; then every member
    /// must have its `journal_identity`.
    pub durable: bool,
}

/// The answer to a [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub struct HelloAck {
    /// Whether the connection is accepted; if not, it is closed after this frame.
    pub accepted: bool,
    /// Why it was refused (empty when accepted).
    pub reason: String,
    /// The refusal is permanent: the sender is not of this cluster (other
    /// cluster name or id, or a journal it cannot share); a node that is
    /// not Up yet stops instead of joining.
    pub fatal: bool,
    /// The receiver's cluster address.
    pub address: String,
    /// The receiver's incarnation uid.
    pub uid: u64,
    /// The receiver's cluster id (empty while it has not learned it).
    pub cluster_id: String,
    /// The receiver's journal identity (as [`Hello::journal_identity`]).
    pub journal_identity: String,
}

/// A member on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub struct WireMember {
    /// Cluster address.
    pub address: String,
    /// Incarnation uid.
    pub uid: u64,
}

/// A region on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub struct WireRegion {
    /// Its member.
    pub member: WireMember,
    /// Its data core.
    pub core: u16,
}

/// [`CoordinatorMsg`] on the wire (field meanings as there).
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub enum WireCoordinatorMsg {
    Register {
        region: WireRegion,
        hosted: Vec<(u32, u64)>,
        stopping: Vec<u32>,
    },
    RegisterProxy {
        proxy: WireRegion,
    },
    GetShardHome {
        region: WireRegion,
        shard: u32,
    },
    BeginHandOffAck {
        shard: u32,
        generation: u64,
        region: WireRegion,
    },
    ShardStopped {
        shard: u32,
        generation: u64,
        region: WireRegion,
    },
    GracefulShutdownReq {
        region: WireRegion,
    },
}

/// [`RegionMsg`] on the wire (field meanings as there).
#[allow(missing_docs)]
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub enum WireRegionMsg {
    RegisterAck,
    ShardHome {
        shard: u32,
        region: WireRegion,
        generation: u64,
    },
    ShardHomes {
        homes: Vec<(u32, WireRegion, u64)>,
    },
    BeginHandOff {
        shard: u32,
        generation: u64,
        owner: WireRegion,
    },
    HandOff {
        shard: u32,
        generation: u64,
    },
    StartEntity {
        shard: u32,
        entity: String,
    },
    BeginHandOffAck {
        shard: u32,
        generation: u64,
        region: WireRegion,
    },
}

/// [`CoordinatorEvent`] on the wire (field meanings as there).
#[allow(missing_docs, clippy::enum_variant_names)]
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs, clippy::enum_variant_names)))]
pub enum WireCoordinatorEvent {
    ShardRegionRegistered {
        region: WireRegion,
    },
    ShardRegionProxyRegistered {
        proxy: WireRegion,
    },
    ShardRegionTerminated {
        region: WireRegion,
    },
    ShardRegionProxyTerminated {
        proxy: WireRegion,
    },
    ShardHomeAllocated {
        shard: u32,
        region: WireRegion,
        generation: u64,
    },
    ShardHomeDeallocated {
        shard: u32,
        generation: u64,
    },
    ShardUnallocated {
        shard: u32,
    },
}

impl From<&CoordinatorEvent> for WireCoordinatorEvent {
    fn from(e: &CoordinatorEvent) -> Self {
        match e {
            CoordinatorEvent::ShardRegionRegistered { region } => {
                WireCoordinatorEvent::ShardRegionRegistered {
                    region: region.into(),
                }
            }
            CoordinatorEvent::ShardRegionProxyRegistered { proxy } => {
                WireCoordinatorEvent::ShardRegionProxyRegistered {
                    proxy: proxy.into(),
                }
            }
            CoordinatorEvent::ShardRegionTerminated { region } => {
                WireCoordinatorEvent::ShardRegionTerminated {
                    region: region.into(),
                }
            }
            CoordinatorEvent::ShardRegionProxyTerminated { proxy } => {
                WireCoordinatorEvent::ShardRegionProxyTerminated {
                    proxy: proxy.into(),
                }
            }
            CoordinatorEvent::ShardHomeAllocated {
                shard,
                region,
                generation,
            } => WireCoordinatorEvent::ShardHomeAllocated {
                shard: shard.0,
                region: region.into(),
                generation: generation.0,
            },
            CoordinatorEvent::ShardHomeDeallocated { shard, generation } => {
                WireCoordinatorEvent::ShardHomeDeallocated {
                    shard: shard.0,
                    generation: generation.0,
                }
            }
            CoordinatorEvent::ShardUnallocated { shard } => {
                WireCoordinatorEvent::ShardUnallocated { shard: shard.0 }
            }
        }
    }
}

impl From<WireCoordinatorEvent> for CoordinatorEvent {
    fn from(e: WireCoordinatorEvent) -> Self {
        match e {
            WireCoordinatorEvent::ShardRegionRegistered { region } => {
                CoordinatorEvent::ShardRegionRegistered {
                    region: region.into(),
                }
            }
            WireCoordinatorEvent::ShardRegionProxyRegistered { proxy } => {
                CoordinatorEvent::ShardRegionProxyRegistered {
                    proxy: proxy.into(),
                }
            }
            WireCoordinatorEvent::ShardRegionTerminated { region } => {
                CoordinatorEvent::ShardRegionTerminated {
                    region: region.into(),
                }
            }
            WireCoordinatorEvent::ShardRegionProxyTerminated { proxy } => {
                CoordinatorEvent::ShardRegionProxyTerminated {
                    proxy: proxy.into(),
                }
            }
            WireCoordinatorEvent::ShardHomeAllocated {
                shard,
                region,
                generation,
            } => CoordinatorEvent::ShardHomeAllocated {
                shard: ShardId(shard),
                region: region.into(),
                generation: Generation(generation),
            },
            WireCoordinatorEvent::ShardHomeDeallocated { shard, generation } => {
                CoordinatorEvent::ShardHomeDeallocated {
                    shard: ShardId(shard),
                    generation: Generation(generation),
                }
            }
            WireCoordinatorEvent::ShardUnallocated { shard } => {
                CoordinatorEvent::ShardUnallocated {
                    shard: ShardId(shard),
                }
            }
        }
    }
}

/// A frame on a control lane.
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub enum ControlFrame {
    /// A membership message (`shardline_core::cluster::encode` bytes).
    Cluster {
        /// The encoded `ClusterMessage`.
        bytes: Vec<u8>,
    },
    /// For the coordinator of `type_name` (on the receiving node).
    ToCoordinator {
        /// Entity type.
        type_name: String,
        /// The message.
        msg: WireCoordinatorMsg,
    },
    /// Coordinator events of `type_name`, replicated to every member so
    /// that the next coordinator (on another member) recovers the state.
    CoordinatorEvents {
        /// Entity type.
        type_name: String,
        /// Replace the receiver's copy instead of appending (a snapshot).
        reset: bool,
        /// The events, in order.
        events: Vec<WireCoordinatorEvent>,
    },
    /// For region `to` of `type_name`.
    ToRegion {
        /// Entity type.
        type_name: String,
        /// Destination region (on the receiving node).
        to: WireRegion,
        /// The message.
        msg: WireRegionMsg,
    },
    /// Asks the receiver for its regions' stats of `type_name` (Akka's
    /// `GetClusterShardingStats` fan-out); answered with
    /// [`ControlFrame::StatsReply`] on the control lane to `reply_to`.
    StatsRequest {
        /// Chosen by the asker to match the answer.
        id: u64,
        /// Entity type.
        type_name: String,
        /// The asker's cluster address.
        reply_to: String,
    },
    /// The sender's cluster id, sent on every control lane when the
    /// sender establishes or learns it after the lane's handshake.
    Identity {
        /// The cluster id.
        cluster_id: String,
    },
    /// The answer to a [`ControlFrame::StatsRequest`].
    StatsReply {
        /// The request's id.
        id: u64,
        /// The answering member.
        member: WireMember,
        /// Its regions of the type.
        regions: Vec<WireRegionStats>,
    },
    /// A coordinator admin command forwarded to the member that runs the
    /// coordinators (the oldest); answered with
    /// [`ControlFrame::CoordinatorAdminReply`] to `reply_to`.
    CoordinatorAdminRequest {
        /// Chosen by the asker to match the answer.
        id: u64,
        /// `false`: the allocation table; `true`: one rebalance round.
        rebalance: bool,
        /// The entity type of a rebalance (`None`: every type).
        type_name: Option<String>,
        /// The asker's cluster address.
        reply_to: String,
    },
    /// The answer to a [`ControlFrame::CoordinatorAdminRequest`].
    CoordinatorAdminReply {
        /// The request's id.
        id: u64,
        /// A client status code (`Status as u8`): 0 with a JSON body, else
        /// the body is the reason as text.
        status: u8,
        /// JSON or the reason.
        body: Vec<u8>,
    },
}

/// One region's stats in a [`ControlFrame::StatsReply`] (fields as in
/// `status::RegionShardStats`).
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
#[allow(missing_docs)]
pub struct WireRegionStats {
    pub core: u16,
    pub proxy: bool,
    pub registered: bool,
    /// (shard, live entities).
    pub shards: Vec<(u32, u32)>,
    pub buffered: u64,
    pub dead_letters: u64,
}

/// A frame on a data lane.
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub enum DataFrame {
    /// A user message forwarded to its home region.
    Forward {
        /// Chosen by the sender to match the reply.
        tag: u64,
        /// Entity type (archived as a `String`; up to 24 bytes kept inline
        /// on the sending side, so a forward copies no name to the heap).
        type_name: compact_str::CompactString,
        /// Entity id (archived as a `String`, inline as the type name).
        entity_id: compact_str::CompactString,
        /// Its shard.
        shard: u32,
        /// The message bytes, as the client sent them (archived as a
        /// `Vec<u8>`; a view of the received bytes on the sending side).
        payload: bytes::Bytes,
        /// Time left until the request's ask deadline when it was sent, in
        /// milliseconds (at least 1); 0: no deadline. The receiver answers
        /// `Unavailable` instead of delivering it after that time.
        deadline_ms: u32,
    },
    /// The reply to a forwarded message.
    Reply {
        /// The `Forward`'s tag.
        tag: u64,
        /// A `Status` code.
        status: u8,
        /// The reply bytes.
        payload: Vec<u8>,
    },
    /// A lifecycle system message (watch, unwatch, terminated) for entity
    /// `entity_id` of `type_name`, routed like `Forward` but unanswered.
    System {
        /// Entity type of the recipient.
        type_name: String,
        /// Entity id of the recipient.
        entity_id: String,
        /// Its shard.
        shard: u32,
        /// 0 watch, 1 unwatch, 2 terminated.
        kind: u8,
        /// Type of the peer: the watcher (watch, unwatch) or the stopped
        /// entity (terminated).
        peer_type: String,
        /// Id of the peer.
        peer_id: String,
        /// `TerminatedReason` code (terminated only; else 0).
        reason: u8,
    },
}

impl From<&UniqueAddress> for WireMember {
    fn from(u: &UniqueAddress) -> Self {
        WireMember {
            address: u.address.0.to_string(),
            uid: u.uid.0,
        }
    }
}

impl From<WireMember> for UniqueAddress {
    fn from(w: WireMember) -> Self {
        UniqueAddress {
            address: Address(w.address.into()),
            uid: MemberUid(w.uid),
        }
    }
}

impl From<&RegionId> for WireRegion {
    fn from(r: &RegionId) -> Self {
        WireRegion {
            member: (&r.member).into(),
            core: r.core,
        }
    }
}

impl From<WireRegion> for RegionId {
    fn from(w: WireRegion) -> Self {
        RegionId {
            member: w.member.into(),
            core: w.core,
        }
    }
}

impl From<&CoordinatorMsg> for WireCoordinatorMsg {
    fn from(m: &CoordinatorMsg) -> Self {
        match m {
            CoordinatorMsg::Register {
                region,
                hosted,
                stopping,
            } => WireCoordinatorMsg::Register {
                region: region.into(),
                hosted: hosted.iter().map(|(s, g)| (s.0, g.0)).collect(),
                stopping: stopping.iter().map(|s| s.0).collect(),
            },
            CoordinatorMsg::RegisterProxy { proxy } => WireCoordinatorMsg::RegisterProxy {
                proxy: proxy.into(),
            },
            CoordinatorMsg::GetShardHome { region, shard } => WireCoordinatorMsg::GetShardHome {
                region: region.into(),
                shard: shard.0,
            },
            CoordinatorMsg::BeginHandOffAck {
                shard,
                generation,
                region,
            } => WireCoordinatorMsg::BeginHandOffAck {
                shard: shard.0,
                generation: generation.0,
                region: region.into(),
            },
            CoordinatorMsg::ShardStopped {
                shard,
                generation,
                region,
            } => WireCoordinatorMsg::ShardStopped {
                shard: shard.0,
                generation: generation.0,
                region: region.into(),
            },
            CoordinatorMsg::GracefulShutdownReq { region } => {
                WireCoordinatorMsg::GracefulShutdownReq {
                    region: region.into(),
                }
            }
        }
    }
}

impl From<WireCoordinatorMsg> for CoordinatorMsg {
    fn from(m: WireCoordinatorMsg) -> Self {
        match m {
            WireCoordinatorMsg::Register {
                region,
                hosted,
                stopping,
            } => CoordinatorMsg::Register {
                region: region.into(),
                hosted: hosted
                    .into_iter()
                    .map(|(s, g)| (ShardId(s), Generation(g)))
                    .collect(),
                stopping: stopping.into_iter().map(ShardId).collect(),
            },
            WireCoordinatorMsg::RegisterProxy { proxy } => CoordinatorMsg::RegisterProxy {
                proxy: proxy.into(),
            },
            WireCoordinatorMsg::GetShardHome { region, shard } => CoordinatorMsg::GetShardHome {
                region: region.into(),
                shard: ShardId(shard),
            },
            WireCoordinatorMsg::BeginHandOffAck {
                shard,
                generation,
                region,
            } => CoordinatorMsg::BeginHandOffAck {
                shard: ShardId(shard),
                generation: Generation(generation),
                region: region.into(),
            },
            WireCoordinatorMsg::ShardStopped {
                shard,
                generation,
                region,
            } => CoordinatorMsg::ShardStopped {
                shard: ShardId(shard),
                generation: Generation(generation),
                region: region.into(),
            },
            WireCoordinatorMsg::GracefulShutdownReq { region } => {
                CoordinatorMsg::GracefulShutdownReq {
                    region: region.into(),
                }
            }
        }
    }
}

impl From<&RegionMsg> for WireRegionMsg {
    fn from(m: &RegionMsg) -> Self {
        match m {
            RegionMsg::RegisterAck => WireRegionMsg::RegisterAck,
            RegionMsg::ShardHome {
                shard,
                region,
                generation,
            } => WireRegionMsg::ShardHome {
                shard: shard.0,
                region: region.into(),
                generation: generation.0,
            },
            RegionMsg::ShardHomes { homes } => WireRegionMsg::ShardHomes {
                homes: homes.iter().map(|(s, r, g)| (s.0, r.into(), g.0)).collect(),
            },
            RegionMsg::BeginHandOff {
                shard,
                generation,
                owner,
            } => WireRegionMsg::BeginHandOff {
                shard: shard.0,
                generation: generation.0,
                owner: owner.into(),
            },
            RegionMsg::HandOff { shard, generation } => WireRegionMsg::HandOff {
                shard: shard.0,
                generation: generation.0,
            },
            RegionMsg::StartEntity { shard, entity } => WireRegionMsg::StartEntity {
                shard: shard.0,
                entity: entity.as_str().to_string(),
            },
            RegionMsg::BeginHandOffAck {
                shard,
                generation,
                region,
            } => WireRegionMsg::BeginHandOffAck {
                shard: shard.0,
                generation: generation.0,
                region: region.into(),
            },
        }
    }
}

impl TryFrom<WireRegionMsg> for RegionMsg {
    type Error = FrameError;

    fn try_from(m: WireRegionMsg) -> Result<Self, FrameError> {
        Ok(match m {
            WireRegionMsg::RegisterAck => RegionMsg::RegisterAck,
            WireRegionMsg::ShardHome {
                shard,
                region,
                generation,
            } => RegionMsg::ShardHome {
                shard: ShardId(shard),
                region: region.into(),
                generation: Generation(generation),
            },
            WireRegionMsg::ShardHomes { homes } => RegionMsg::ShardHomes {
                homes: homes
                    .into_iter()
                    .map(|(s, r, g)| (ShardId(s), r.into(), Generation(g)))
                    .collect(),
            },
            WireRegionMsg::BeginHandOff {
                shard,
                generation,
                owner,
            } => RegionMsg::BeginHandOff {
                shard: ShardId(shard),
                generation: Generation(generation),
                owner: owner.into(),
            },
            WireRegionMsg::HandOff { shard, generation } => RegionMsg::HandOff {
                shard: ShardId(shard),
                generation: Generation(generation),
            },
            WireRegionMsg::StartEntity { shard, entity } => RegionMsg::StartEntity {
                shard: ShardId(shard),
                entity: EntityId::new(entity).map_err(|e| FrameError::Invalid(e.to_string()))?,
            },
            WireRegionMsg::BeginHandOffAck {
                shard,
                generation,
                region,
            } => RegionMsg::BeginHandOffAck {
                shard: ShardId(shard),
                generation: Generation(generation),
                region: region.into(),
            },
        })
    }
}

/// Deserializes a validated archive into an owned value (control lane only;
/// the data lane reads in place).
///
/// # Errors
/// [`FrameError::Invalid`] when validation or deserialization fails.
pub fn decode_frame_body<T>(body: &[u8]) -> Result<T, FrameError>
where
    T: Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<rkyv::rancor::Error>>,
{
    let a = super::access::<T>(body)?;
    rkyv::deserialize::<T, rkyv::rancor::Error>(a).map_err(|e| FrameError::Invalid(e.to_string()))
}
