//! The data plane: the sans-IO half of a data executor (one per data core).
//!
//! [`DataPlane`] owns the core's `ShardRegion`s (one per entity type) and
//! makes the routing decisions the executor used to make inline: checking
//! a front's request (type, entity id, size, a stopped node), interpreting
//! every [`RegionEffect`], the forwarding bookkeeping (messages forwarded to
//! another node waiting for their reply under a [`ForwardTag`], messages
//! forwarded to another core of this node under a [`LocalToken`], their
//! deadlines), which data lanes to open, the reconnect backoff of a lane
//! that failed, the members removed from the cluster (never connected to
//! again), the registration and hand-off reports to the control executor,
//! and the node's stop. It has no sockets, no timers, no clock and no
//! thread-locals: the driver (`node/core.rs`) feeds it inputs with the
//! time they happened at (`now`, the core's monotonic clock) and carries
//! out its outputs.
//!
//! The entities themselves (their code, timers, lifecycle watches, the
//! journal's deferred replies) are hosted by the driver: the plane hands
//! it [`DataOutput::Deliver`], [`DataOutput::StartEntity`] and
//! [`DataOutput::StopEntity`], and the driver tells the plane what the
//! entities asked ([`DataPlane::handle_passivate`]) and when they stopped
//! ([`DataPlane::handle_entity_stopped`]).
//!
//! # Order of calls
//!
//! After every `handle_*` call, drain [`DataPlane::poll_output`] until it
//! returns `None`, carrying out each output before taking the next one (an
//! entity's delivery may feed the plane more inputs, whose outputs come
//! after those already queued). Outputs are produced lazily, in the order
//! the regions emit their effects, so a delivery is carried out before the
//! region's next effect is interpreted (as Akka's region would run it).
//! Then arm a timer for [`DataPlane::poll_timeout`] and call
//! [`DataPlane::handle_timeout`] when it passes.
//!
//! A [`DataOutput::Transmit`] or [`DataOutput::ToCore`] the driver could
//! not carry out (the lane is over its high-water mark, the frame does not
//! encode, the core's ring is full) is handed back with
//! [`DataPlane::handle_transmit_refused`] or
//! [`DataPlane::handle_core_refused`]: the sender is answered.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::time::Duration;

use shardline_core::ids::{EntityId, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{
    shard_id_of, Envelope, FailureReason, LruPolicy, MembershipEvent, PassivationSettings,
    RegionEffect, RegionMsg, RegionSettings, ShardEvent, ShardRegion, StopReason,
};

use crate::envelope::{access, ArchivedDataFrame, DataFrame, FrameError, Status};
use crate::node::msg::{ReplyTo, ToControl, UserEnvelope};
use crate::node::watch::{EntityKey, SystemMsg};
use crate::node::EntitySettings;
use crate::FastMap;

/// How long a forwarded message without an ask deadline may wait for its
/// reply before the sender is answered `TimedOut`.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);
/// How long past its ask deadline a forwarded message waits for the home
/// node's answer (which is `Unavailable` when it was still buffered there)
/// before the sender is answered `TimedOut`.
pub const FORWARD_GRACE: Duration = Duration::from_millis(500);
/// First and largest reconnect backoff of a data lane.
pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Largest reconnect backoff of a data lane.
pub const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The region type of a data core: user payload bytes, answered to a
/// [`ReplyTo`]; each live entity's table entry also holds the host's
/// [`EntitySlot`].
pub type UserRegion = ShardRegion<bytes::Bytes, ReplyTo, EntitySlot>;

/// What the entity host keeps in a live entity's entry of its region
/// ([`ShardRegion::host_slot_mut`]): the running incarnation, once the host
/// started it (`None` before, and in a plane driven without a host).
pub type EntitySlot = Option<super::host::Live>;

/// The index of an entity type on one core, in the order the types were
/// registered ([`DataPlane::handle_register_type`]); the driver keeps its
/// per-type state in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TypeIdx(pub usize);

/// The tag of a message forwarded to another node, matched by the `Reply`
/// frame that answers it (one id space per core).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ForwardTag(pub u64);

/// The token under which a message forwarded to another core of this node
/// waits for that core's answer (`ReplyTo::Core`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalToken(pub u64);

/// What a [`DataPlane`] is built from.
#[derive(Debug, Clone)]
pub struct DataPlaneConfig {
    /// This core's region id (member and core index).
    pub me: RegionId,
    /// `number_of_shards` of the cluster (count, at least 1).
    pub number_of_shards: u32,
    /// `requests.ask_timeout_ms`: the ask deadline of a front's request.
    pub ask_timeout: Duration,
    /// `requests.max_message_size_bytes`: the largest request payload a
    /// front may hand in (bytes).
    pub max_message_size_bytes: u64,
    /// `coordinator.warm_allocation`: the registration report also says
    /// whether every region knows the home of every shard.
    pub warm_allocation: bool,
}

impl DataPlaneConfig {
    /// The plane's settings from a node's configuration.
    pub fn from_node_config(
        config: &crate::config::NodeConfig,
        me: UniqueAddress,
        core: u16,
    ) -> Self {
        DataPlaneConfig {
            me: RegionId { member: me, core },
            number_of_shards: config.number_of_shards,
            ask_timeout: config.requests.ask_timeout(),
            max_message_size_bytes: config.requests.max_message_size_bytes,
            warm_allocation: config.coordinator.warm_allocation,
        }
    }
}

/// A data frame for the data lane to another node's region.
#[derive(Debug)]
pub struct Transmit {
    /// The region whose lane carries it (member and core).
    pub to: RegionId,
    /// The frame (`Forward` or `System`).
    pub frame: DataFrame,
}

/// What the driver carries out for the plane ([`DataPlane::poll_output`]).
pub enum DataOutput {
    /// Answer a message's sender (a front's connection, an inbound data
    /// lane, another core, an API ask, an entity's ask, or the watch book
    /// for a system message that could not be delivered).
    Reply {
        /// Who is answered.
        to: ReplyTo,
        /// The answer's status.
        status: Status,
        /// The answer's bytes (a reason for a failure).
        payload: Vec<u8>,
    },
    /// A message for the control executor (a region's message for its
    /// coordinator or another region, a registration or hand-off report).
    ToControl(ToControl),
    /// Open a data lane to `to` (none is open and it is not backing off);
    /// [`DataOutput::Transmit`]s for it follow. The driver reports its end
    /// with [`DataPlane::handle_link_closed`].
    OpenLink {
        /// The remote region.
        to: RegionId,
    },
    /// Close the data lane to `to` (its member was removed).
    CloseLink {
        /// The remote region.
        to: RegionId,
    },
    /// Write a frame on the data lane to `to.to`.
    Transmit(Transmit),
    /// Hand a user message to another core of this node (its ring).
    ToCore {
        /// The core's index.
        core: u16,
        /// The entity type (inline up to 24 bytes: no heap copy).
        type_name: compact_str::CompactString,
        /// The message.
        envelope: UserEnvelope,
    },
    /// Run the message on its entity (started first if it is not running;
    /// a `ReplyTo::System` envelope is a lifecycle message for the watch
    /// book).
    Deliver {
        /// The entity type.
        ty: TypeIdx,
        /// The message.
        envelope: UserEnvelope,
    },
    /// Run the message on a stateless worker type's activations.
    ToWorker {
        /// The worker type.
        ty: TypeIdx,
        /// The message.
        envelope: UserEnvelope,
    },
    /// Start the entity (remembered, or `StartEntity`).
    StartEntity {
        /// The entity type.
        ty: TypeIdx,
        /// Its shard.
        shard: ShardId,
        /// The entity.
        entity: EntityId,
    },
    /// Stop the entity (deliver `stop_message` first when there is one);
    /// once it stopped, call [`DataPlane::handle_entity_stopped`].
    StopEntity {
        /// The entity type.
        ty: TypeIdx,
        /// Its shard.
        shard: ShardId,
        /// The entity.
        entity: EntityId,
        /// The message it gets before it stops.
        stop_message: Option<bytes::Bytes>,
        /// Why it stops.
        reason: StopReason,
    },
    /// An entity's timer is due: run its handler if incarnation
    /// `incarnation` of the entity still lives (else drop it).
    TimerFired {
        /// The entity type.
        ty: TypeIdx,
        /// The entity.
        entity: EntityId,
        /// The timer's key (chosen by the entity).
        key: u64,
        /// The incarnation that armed it.
        incarnation: u64,
    },
    /// Record a remembered-entities event of a shard in the journal.
    Persist {
        /// The entity type.
        ty: TypeIdx,
        /// The event.
        event: ShardEvent,
    },
    /// Read the remembered entities of `shard`; answer with
    /// [`DataPlane::handle_remembered_entities`].
    RecoverRememberedEntities {
        /// The entity type.
        ty: TypeIdx,
        /// The shard (waiting in `Recovering`).
        shard: ShardId,
    },
}

/// A reply released by the durability barrier ([`DataPlane::poll_reply`]).
#[derive(Debug)]
pub struct ReleasedReply {
    /// Who is answered.
    pub to: ReplyTo,
    /// The answer's status.
    pub status: Status,
    /// The answer's bytes.
    pub payload: Vec<u8>,
}

/// Where a deferred reply goes once its events are durable.
struct DeferredReply {
    /// The entity incarnation that deferred it.
    incarnation: u64,
    to: ReplyTo,
}

/// An armed entity timer (ordered by due time first).
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct EntityTimer {
    due: Reverse<Duration>,
    ty: TypeIdx,
    entity: EntityId,
    key: u64,
    incarnation: u64,
}

/// One entity type's region on this core.
struct RegionHost {
    name: String,
    region: UserRegion,
    /// A stateless worker type: its messages bypass the region.
    worker: bool,
}

/// A message forwarded to another node, waiting for its reply.
struct PendingForward {
    reply_to: ReplyTo,
    link: RegionId,
    /// When the sender is answered `TimedOut` (core clock).
    deadline: Duration,
}

/// The reconnect backoff of a data lane that failed.
#[derive(Clone, Copy)]
struct Backoff {
    /// No new lane before this time (core clock).
    until: Duration,
    /// The last delay.
    delay: Duration,
}

/// The sans-IO data plane of one data core (see the module doc).
pub struct DataPlane {
    config: DataPlaneConfig,
    types: Vec<RegionHost>,
    /// Outputs made by inputs (replies to refused requests, lane changes),
    /// given out before the regions' next effects.
    out: VecDeque<DataOutput>,
    /// Remote regions whose data lane is open (or connecting).
    links: HashSet<RegionId>,
    backoff: HashMap<RegionId, Backoff>,
    /// Members removed from the cluster (incarnations never come back).
    removed: HashSet<UniqueAddress>,
    forwards: FastMap<ForwardTag, PendingForward>,
    next_forward: u64,
    local_forwards: FastMap<LocalToken, ReplyTo>,
    next_local: u64,
    /// Last reported (every region registered, every region warm).
    reported_registered: (bool, bool),
    reported_shutdown: bool,
    shutting_down: bool,
    stopped: bool,
    /// A registration report may be due: checked when the effects ran out.
    check_due: bool,
    /// Replies held until the events before them are durable, by the
    /// entity's reply token.
    deferred: FastMap<u64, DeferredReply>,
    /// Replies the barrier released, for [`DataPlane::poll_reply`].
    released: VecDeque<ReleasedReply>,
    /// The entities' armed timers.
    timers: BinaryHeap<EntityTimer>,
    /// Timers that came due, given out once the regions' effects ran out.
    fired: VecDeque<EntityTimer>,
}

impl DataPlane {
    /// A plane with no entity types.
    pub fn new(config: DataPlaneConfig) -> Self {
        DataPlane {
            config,
            types: Vec::new(),
            out: VecDeque::new(),
            links: HashSet::new(),
            backoff: HashMap::new(),
            removed: HashSet::new(),
            forwards: FastMap::default(),
            next_forward: 1,
            local_forwards: FastMap::default(),
            next_local: 1,
            reported_registered: (false, true),
            reported_shutdown: false,
            shutting_down: false,
            stopped: false,
            check_due: false,
            deferred: FastMap::default(),
            released: VecDeque::new(),
            timers: BinaryHeap::new(),
            fired: VecDeque::new(),
        }
    }

    /// The index of entity type `t`, if this core runs it.
    pub fn type_index(&self, t: &str) -> Option<TypeIdx> {
        self.types.iter().position(|h| h.name == t).map(TypeIdx)
    }

    /// The name of entity type `ty`.
    pub fn type_name(&self, ty: TypeIdx) -> &str {
        &self.types[ty.0].name
    }

    /// The number of entity types (count).
    pub fn type_count(&self) -> usize {
        self.types.len()
    }

    /// The region of entity type `ty` (read only: status, journal keys).
    pub fn region(&self, ty: TypeIdx) -> &UserRegion {
        &self.types[ty.0].region
    }

    /// The host's slot of entity `entity` of `shard` of `ty` while it is
    /// live here (active or stopping); `None` when it is not.
    pub(crate) fn entity_slot_mut(
        &mut self,
        ty: TypeIdx,
        shard: ShardId,
        entity: &EntityId,
    ) -> Option<&mut EntitySlot> {
        self.types
            .get_mut(ty.0)?
            .region
            .host_slot_mut(shard, entity)
    }

    /// Whether entity `entity` of `shard` of `ty` is live here with an
    /// incarnation the host started.
    pub(crate) fn entity_running(&self, ty: TypeIdx, shard: ShardId, entity: &EntityId) -> bool {
        self.types
            .get(ty.0)
            .and_then(|t| t.region.host_slot(shard, entity))
            .is_some_and(|s| s.is_some())
    }

    /// Whether entity `entity` of `shard` of `ty` is stopping here
    /// ([`ShardRegion::is_entity_stopping`]).
    pub(crate) fn entity_stopping(&self, ty: TypeIdx, shard: ShardId, entity: &EntityId) -> bool {
        self.types
            .get(ty.0)
            .is_some_and(|t| t.region.is_entity_stopping(shard, entity))
    }

    /// Every live entity's host slot of type `ty`, with its shard and id.
    pub(crate) fn entity_slots_mut(
        &mut self,
        ty: TypeIdx,
    ) -> impl Iterator<Item = (ShardId, &EntityId, &mut EntitySlot)> + '_ {
        self.types
            .get_mut(ty.0)
            .into_iter()
            .flat_map(|t| t.region.host_slots_mut())
    }

    /// Makes entity `entity` of `shard` of `ty` live here for a message
    /// the host holds whose incarnation stopped before it ran
    /// ([`ShardRegion::activate_for_host`]); whether it is live now.
    pub(crate) fn activate_for_host(
        &mut self,
        now: Duration,
        ty: TypeIdx,
        shard: ShardId,
        entity: &EntityId,
    ) -> bool {
        self.check_due = true;
        self.types
            .get_mut(ty.0)
            .is_some_and(|t| t.region.activate_for_host(now, shard, entity))
    }

    /// Whether the node stopped ([`DataPlane::handle_stop`]).
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Whether the graceful hand-off began.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down
    }

    /// The shard of `entity`.
    pub fn shard_of(&self, entity: &EntityId) -> ShardId {
        shard_id_of(entity.as_str(), self.config.number_of_shards)
    }

    /// The region settings of an entity type's settings.
    pub fn region_settings(s: &EntitySettings) -> RegionSettings {
        RegionSettings {
            buffer_size: s.buffer_size,
            passivation: PassivationSettings {
                idle_timeout: s.idle_timeout,
                active_entity_limit: s.active_entity_limit,
            },
            remember_entities: s.remember_entities,
            remember_entities_pace: s.remember_entities_pace,
            ..RegionSettings::default()
        }
    }

    // ----- inputs -----

    /// Starts the region of entity type `name` (`hosts_entities` false: a
    /// proxy; `worker`: a stateless worker type, whose messages go to
    /// [`DataOutput::ToWorker`]). `None` when the type already runs here.
    pub fn handle_register_type(
        &mut self,
        now: Duration,
        name: &str,
        settings: RegionSettings,
        hosts_entities: bool,
        worker: bool,
    ) -> Option<TypeIdx> {
        if self.type_index(name).is_some() {
            return None;
        }
        let id = self.config.me.clone();
        let mut region = if hosts_entities {
            ShardRegion::new(id, settings, Box::new(LruPolicy::new()), now)
        } else {
            ShardRegion::new_proxy(id, settings, now)
        };
        region.set_passive_filter(|e| matches!(e.sender, ReplyTo::System(_)));
        // A buffered message gets its own copy of its payload: a view of
        // the connection's receive buffer would keep the whole buffer (64
        // KiB or more) alive for as long as the message waits.
        region.set_buffer_hook(detach_payload);
        self.types.push(RegionHost {
            name: name.to_string(),
            region,
            worker,
        });
        // Force a report of the new state.
        self.reported_registered = (true, true);
        self.check_due = true;
        Some(TypeIdx(self.types.len() - 1))
    }

    /// One entity request of a front on connection `conn`: refused with a
    /// typed answer (type name not UTF-8 or unknown, bad entity id, node
    /// stopped, payload over `max_message_size_bytes`), else routed with
    /// the ask deadline `now + ask_timeout`.
    pub fn handle_client_request(
        &mut self,
        now: Duration,
        conn: u64,
        request_id: u64,
        type_name: &[u8],
        entity_id: &[u8],
        payload: bytes::Bytes,
    ) {
        let to = ReplyTo::Client { conn, request_id };
        let Ok(t) = std::str::from_utf8(type_name) else {
            return self.reply(
                to,
                Status::InvalidEntityId,
                b"type name is not UTF-8".to_vec(),
            );
        };
        let Some(ty) = self.type_index(t) else {
            let msg = format!("unknown entity type `{}`", t.escape_debug());
            return self.reply(to, Status::UnknownEntityType, msg.into_bytes());
        };
        let id = match EntityId::from_bytes(entity_id) {
            Ok(id) => id,
            Err(e) => return self.reply(to, Status::InvalidEntityId, e.to_string().into_bytes()),
        };
        if self.stopped {
            return self.reply(to, Status::ShuttingDown, b"node stopped".to_vec());
        }
        if payload.len() as u64 > self.config.max_message_size_bytes {
            let msg = format!(
                "message of {} bytes exceeds requests.max_message_size_bytes ({})",
                payload.len(),
                self.config.max_message_size_bytes
            );
            return self.reply(to, Status::TooLarge, msg.into_bytes());
        }
        let env = Envelope {
            deadline: Some(now + self.config.ask_timeout),
            shard: self.shard_of(&id),
            entity: id,
            sender: to,
            payload,
        };
        self.route_idx(now, ty, env);
    }

    /// A user message for entity type `t` (from the embedding API, another
    /// core, an entity, or the watch book): routed by its region, or
    /// answered `UnknownEntityType` / `ShuttingDown`.
    pub fn handle_message(&mut self, now: Duration, t: &str, env: UserEnvelope) {
        if self.stopped {
            // Its entities are gone: nothing is delivered any more.
            return self.reply(env.sender, Status::ShuttingDown, b"node stopped".to_vec());
        }
        match self.type_index(t) {
            Some(ty) => self.route_idx(now, ty, env),
            None => {
                let msg = format!("unknown entity type `{t}`").into_bytes();
                self.reply(env.sender, Status::UnknownEntityType, msg)
            }
        }
    }

    fn route_idx(&mut self, now: Duration, ty: TypeIdx, env: UserEnvelope) {
        if self.stopped {
            return self.reply(env.sender, Status::ShuttingDown, b"node stopped".to_vec());
        }
        let h = &mut self.types[ty.0];
        if h.worker {
            if matches!(env.sender, ReplyTo::System(_)) {
                // Worker activations are not addressable: nothing to watch.
                return self.reply(env.sender, Status::UnknownEntityType, Vec::new());
            }
            self.out
                .push_back(DataOutput::ToWorker { ty, envelope: env });
            return;
        }
        h.region.handle_message(now, env);
        self.check_due = true;
    }

    /// A frame on an inbound data lane (`conn`: the lane's connection id,
    /// which the answers of its `Forward`s go to). `Err` (the frame does
    /// not decode, a bad entity id, a frame that belongs on an outbound
    /// lane): the driver closes the lane; the plane is unchanged.
    pub fn handle_data_frame(
        &mut self,
        now: Duration,
        conn: u64,
        body: &bytes::Bytes,
    ) -> Result<(), FrameError> {
        match access::<DataFrame>(body)? {
            ArchivedDataFrame::Forward {
                tag,
                type_name,
                entity_id,
                shard,
                payload,
                deadline_ms,
            } => {
                let id = EntityId::new(entity_id.as_str())
                    .map_err(|e| FrameError::Invalid(e.to_string()))?;
                let left = deadline_ms.to_native();
                let env = Envelope {
                    deadline: (left > 0).then(|| now + Duration::from_millis(u64::from(left))),
                    entity: id,
                    shard: ShardId(shard.to_native()),
                    sender: ReplyTo::Remote {
                        conn,
                        tag: tag.to_native(),
                    },
                    // A view of the lane's received bytes: not copied.
                    payload: body.slice_ref(payload.as_slice()),
                };
                self.handle_message(now, type_name.as_str(), env);
                Ok(())
            }
            ArchivedDataFrame::Reply { .. } => {
                Err(FrameError::Invalid("reply on an inbound data lane".into()))
            }
            ArchivedDataFrame::System {
                type_name,
                entity_id,
                shard,
                kind,
                peer_type,
                peer_id,
                reason,
            } => {
                let bad = |e: String| FrameError::Invalid(e);
                let to = EntityKey {
                    type_name: type_name.as_str().to_string(),
                    id: EntityId::new(entity_id.as_str()).map_err(|e| bad(e.to_string()))?,
                };
                let peer = EntityKey {
                    type_name: peer_type.as_str().to_string(),
                    id: EntityId::new(peer_id.as_str()).map_err(|e| bad(e.to_string()))?,
                };
                let msg = SystemMsg::from_wire(*kind, peer, *reason, to.clone()).map_err(bad)?;
                let env = Envelope {
                    deadline: None,
                    entity: to.id,
                    shard: ShardId(shard.to_native()),
                    sender: ReplyTo::System(Box::new(msg)),
                    payload: bytes::Bytes::new(),
                };
                self.handle_message(now, &to.type_name, env);
                Ok(())
            }
        }
    }

    /// A frame on an outbound data lane: the reply to a forwarded message
    /// (a reply whose message is no longer waiting is dropped). `Err`: the
    /// frame does not decode or is not a reply; the driver closes the lane.
    /// `reply_buf` is an empty buffer the reply's payload is copied into (a
    /// spare reply buffer of the core, so that relaying a reply allocates
    /// nothing; `Vec::new()` will do).
    pub fn handle_link_frame(
        &mut self,
        body: &[u8],
        mut reply_buf: Vec<u8>,
    ) -> Result<(), FrameError> {
        match access::<DataFrame>(body)? {
            ArchivedDataFrame::Reply {
                tag,
                status,
                payload,
            } => {
                let status = Status::from_u8(*status)
                    .ok_or_else(|| FrameError::Invalid(format!("status {}", status)))?;
                if let Some(p) = self.forwards.remove(&ForwardTag(tag.to_native())) {
                    reply_buf.clear();
                    reply_buf.extend_from_slice(payload.as_slice());
                    self.reply(p.reply_to, status, reply_buf);
                }
                Ok(())
            }
            ArchivedDataFrame::Forward { .. } | ArchivedDataFrame::System { .. } => Err(
                FrameError::Invalid("forward on an outbound data lane".into()),
            ),
        }
    }

    /// The data lane to `to` closed (`current`: it was the lane the plane
    /// asked for last, not an older one). Messages waiting for a reply on
    /// it are answered `TimedOut` when the lane had connected (they may
    /// have reached their entity), `Unavailable` when it never did (connect
    /// or handshake failed: nothing was written). The next lane waits for
    /// a backoff (100 ms doubling to 2 s).
    pub fn handle_link_closed(
        &mut self,
        now: Duration,
        to: &RegionId,
        connected: bool,
        current: bool,
    ) {
        if current {
            self.links.remove(to);
        }
        let next = self
            .backoff
            .get(to)
            .map(|b| (b.delay * 2).min(BACKOFF_MAX))
            .unwrap_or(BACKOFF_MIN);
        self.backoff.insert(
            to.clone(),
            Backoff {
                until: now + next,
                delay: next,
            },
        );
        let mut dead: Vec<ForwardTag> = self
            .forwards
            .iter()
            .filter(|(_, p)| p.link == *to)
            .map(|(t, _)| *t)
            .collect();
        // In the order they were sent, not the map's (seeded) order.
        dead.sort_unstable();
        for t in dead {
            if let Some(p) = self.forwards.remove(&t) {
                if connected {
                    self.reply(
                        p.reply_to,
                        Status::TimedOut,
                        b"connection to the home node lost".to_vec(),
                    );
                } else {
                    self.reply(
                        p.reply_to,
                        Status::Unavailable,
                        b"home node unreachable; not delivered".to_vec(),
                    );
                }
            }
        }
    }

    /// A [`Transmit`] the driver could not write (`status`: `BufferFull`
    /// for a lane over its high-water mark, `TooLarge` for a frame that
    /// does not encode; `why`: the reason for the sender).
    pub fn handle_transmit_refused(&mut self, t: Transmit, status: Status, why: Vec<u8>) {
        match t.frame {
            DataFrame::Forward { tag, .. } => {
                if let Some(p) = self.forwards.remove(&ForwardTag(tag)) {
                    self.reply(p.reply_to, status, why);
                }
            }
            DataFrame::System {
                type_name,
                entity_id,
                kind,
                peer_type,
                peer_id,
                reason,
                ..
            } => {
                let (Ok(id), Ok(pid)) = (EntityId::new(entity_id), EntityId::new(peer_id)) else {
                    return;
                };
                let to = EntityKey { type_name, id };
                let peer = EntityKey {
                    type_name: peer_type,
                    id: pid,
                };
                if let Ok(m) = SystemMsg::from_wire(kind, peer, reason, to) {
                    self.reply(ReplyTo::System(Box::new(m)), Status::BufferFull, Vec::new());
                }
            }
            DataFrame::Reply { .. } => {}
        }
    }

    /// A [`DataOutput::ToCore`] whose ring was full or closed: its sender
    /// is answered `BufferFull`.
    pub fn handle_core_refused(&mut self, envelope: UserEnvelope) {
        match envelope.sender {
            ReplyTo::Core { core, token } if core == self.config.me.core => {
                if let Some(orig) = self.local_forwards.remove(&LocalToken(token)) {
                    self.reply(orig, Status::BufferFull, b"core ring full".to_vec());
                }
            }
            s => self.reply(s, Status::BufferFull, Vec::new()),
        }
    }

    /// The answer of another core to a message this core forwarded to it
    /// ([`LocalToken`]); dropped when nobody waits any more.
    pub fn handle_local_reply(&mut self, token: u64, status: Status, payload: Vec<u8>) {
        if let Some(to) = self.local_forwards.remove(&LocalToken(token)) {
            self.reply(to, status, payload);
        }
    }

    /// Forwards a message for worker type `ty` to the worker's pool on
    /// core `to_core` (a worker type that runs on other cores).
    pub fn handle_worker_forward(&mut self, ty: TypeIdx, to_core: u16, env: UserEnvelope) {
        let t = self.types[ty.0].name.clone();
        self.forward_local(&t, to_core, env);
    }

    /// A control message for this core's region of `t` (unknown types are
    /// ignored).
    pub fn handle_region_msg(&mut self, now: Duration, t: &str, msg: RegionMsg) {
        if let Some(ty) = self.type_index(t) {
            self.types[ty.0].region.handle_region_msg(now, msg);
            self.check_due = true;
        }
    }

    /// A membership change: every region learns it. A removed member is
    /// never connected to again: its lanes close
    /// ([`DataOutput::CloseLink`]) and forwards to it fail at once.
    pub fn handle_membership(&mut self, now: Duration, ev: &MembershipEvent) {
        if let MembershipEvent::MemberRemoved(m) = ev {
            self.removed.insert(m.clone());
            let mut gone: Vec<RegionId> = self
                .links
                .iter()
                .filter(|r| r.member == *m)
                .cloned()
                .collect();
            gone.sort_by_key(|r| r.core);
            for r in gone {
                self.links.remove(&r);
                self.out.push_back(DataOutput::CloseLink { to: r });
            }
        }
        for h in &mut self.types {
            h.region.handle_membership(now, ev);
        }
        self.check_due = true;
    }

    /// The coordinator moved: every region registers again.
    pub fn handle_coordinator_moved(&mut self, now: Duration) {
        for h in &mut self.types {
            h.region.handle_coordinator_moved(now);
        }
        self.check_due = true;
    }

    /// The graceful hand-off of every region begins; once every region
    /// that hosts shards handed them off, `ToControl::ShutdownComplete` is
    /// given out.
    pub fn handle_graceful_shutdown(&mut self, now: Duration) {
        self.shutting_down = true;
        for h in &mut self.types {
            h.region.start_graceful_shutdown(now);
        }
        self.check_due = true;
    }

    /// The node stopped (left, downed, or exits): every message the regions
    /// still buffer is answered `ShuttingDown` (a dead letter), and from
    /// now on every message is. Returns how many were answered (count);
    /// the driver stops the entities. Idempotent (0 the second time).
    pub fn handle_stop(&mut self) -> usize {
        if self.stopped {
            return 0;
        }
        self.stopped = true;
        let mut answered = 0;
        for h in &mut self.types {
            answered += h.region.fail_all_buffered(FailureReason::ShuttingDown);
        }
        answered
    }

    /// The stop drain ended: messages forwarded to other nodes or cores
    /// without a reply yet are answered `TimedOut` (they may have reached
    /// their entity). Returns how many (count).
    pub fn handle_drain_end(&mut self) -> usize {
        // In the order they were sent, not the maps' (seeded) order.
        let mut pending: Vec<(ForwardTag, PendingForward)> = self.forwards.drain().collect();
        pending.sort_unstable_by_key(|(t, _)| *t);
        let mut local: Vec<(LocalToken, ReplyTo)> = self.local_forwards.drain().collect();
        local.sort_unstable_by_key(|(t, _)| *t);
        let (pending, local): (Vec<PendingForward>, Vec<ReplyTo>) = (
            pending.into_iter().map(|(_, p)| p).collect(),
            local.into_iter().map(|(_, r)| r).collect(),
        );
        let n = pending.len() + local.len();
        for p in pending {
            self.reply(
                p.reply_to,
                Status::TimedOut,
                b"node stopped before the home node answered".to_vec(),
            );
        }
        for r in local {
            self.reply(
                r,
                Status::TimedOut,
                b"node stopped before the home core answered".to_vec(),
            );
        }
        n
    }

    /// Entity `entity` of `ty` asked to passivate (its region stops it
    /// after its queued messages: a [`DataOutput::StopEntity`] follows).
    pub fn handle_passivate(
        &mut self,
        now: Duration,
        ty: TypeIdx,
        shard: ShardId,
        entity: &EntityId,
    ) {
        self.types[ty.0]
            .region
            .handle_passivate(now, shard, entity, None);
        self.check_due = true;
    }

    /// Entity `entity` of `ty` stopped (after a [`DataOutput::StopEntity`],
    /// or because it failed).
    pub fn handle_entity_stopped(
        &mut self,
        now: Duration,
        ty: TypeIdx,
        shard: ShardId,
        entity: &EntityId,
    ) {
        self.types[ty.0]
            .region
            .handle_entity_stopped(now, shard, entity);
        self.check_due = true;
    }

    /// The remembered entities of `shard` of `ty` were read.
    pub fn handle_remembered_entities(
        &mut self,
        now: Duration,
        ty: TypeIdx,
        shard: ShardId,
        ids: Vec<EntityId>,
    ) {
        self.types[ty.0]
            .region
            .handle_remembered_entities(now, shard, ids);
        self.check_due = true;
    }

    // ----- entity timers -----

    /// What an entity's handler asked of its timers: `(key, Some(delay))`
    /// arms (or re-arms) timer `key` to fire `delay` after `now`,
    /// `(key, None)` cancels it. A timer fires as
    /// [`DataOutput::TimerFired`] with the incarnation that armed it.
    pub fn handle_entity_timers(
        &mut self,
        now: Duration,
        ty: TypeIdx,
        entity: &EntityId,
        incarnation: u64,
        timers: Vec<(u64, Option<Duration>)>,
    ) {
        for (key, delay) in timers {
            // A key armed again replaces the older entry.
            self.timers
                .retain(|e| !(e.key == key && e.ty == ty && e.entity == *entity));
            if let Some(d) = delay {
                self.timers.push(EntityTimer {
                    due: Reverse(now + d),
                    ty,
                    entity: entity.clone(),
                    key,
                    incarnation,
                });
            }
        }
    }

    // ----- the durability barrier for replies -----

    /// An entity (incarnation `incarnation`) handled a message whose reply
    /// waits until the events it persisted are durable: the reply to `to`
    /// is held under the entity's reply `token` until
    /// [`DataPlane::handle_reply_durable`] (or the incarnation stops).
    pub fn handle_reply_deferred(&mut self, token: u64, incarnation: u64, to: ReplyTo) {
        self.deferred
            .insert(token, DeferredReply { incarnation, to });
    }

    /// The journal made the events before deferred reply `token` durable
    /// and the entity answered it: the reply is released to
    /// [`DataPlane::poll_reply`]. Returns whether a reply was held under
    /// `token`.
    pub fn handle_reply_durable(&mut self, token: u64, status: Status, payload: Vec<u8>) -> bool {
        match self.deferred.remove(&token) {
            Some(d) => {
                self.released.push_back(ReleasedReply {
                    to: d.to,
                    status,
                    payload,
                });
                true
            }
            None => false,
        }
    }

    /// Incarnation `incarnation` stopped: the replies it still held are
    /// released as `EntityFailed` (their events may not be durable).
    pub fn handle_incarnation_stopped(&mut self, incarnation: u64) {
        if self.deferred.is_empty() {
            return;
        }
        let mut tokens: Vec<u64> = self
            .deferred
            .iter()
            .filter(|(_, d)| d.incarnation == incarnation)
            .map(|(t, _)| *t)
            .collect();
        tokens.sort_unstable();
        for t in tokens {
            if let Some(d) = self.deferred.remove(&t) {
                self.released.push_back(ReleasedReply {
                    to: d.to,
                    status: Status::EntityFailed,
                    payload: b"entity stopped".to_vec(),
                });
            }
        }
    }

    /// The next reply the durability barrier released (drain after
    /// [`DataPlane::handle_reply_durable`] and
    /// [`DataPlane::handle_incarnation_stopped`]).
    pub fn poll_reply(&mut self) -> Option<ReleasedReply> {
        self.released.pop_front()
    }

    /// When [`DataPlane::handle_timeout`] is due next (core clock): the
    /// regions' timers (passivation, retries, hand-off), the entities'
    /// timers and the deadlines of messages forwarded to other nodes.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let regions = self.types.iter().filter_map(|h| h.region.poll_timeout());
        let forwards = self.forwards.values().map(|p| p.deadline);
        let timers = self.timers.peek().map(|e| e.due.0);
        regions.chain(forwards).chain(timers).min()
    }

    /// Time passed: regions whose timer is due handle it, entity timers
    /// that are due fire (after the regions' effects), and messages
    /// forwarded to other nodes past their deadline are answered
    /// `TimedOut`.
    pub fn handle_timeout(&mut self, now: Duration) {
        for h in &mut self.types {
            if h.region.poll_timeout().is_some_and(|d| d <= now) {
                h.region.handle_timeout(now);
                self.check_due = true;
            }
        }
        while self.timers.peek().is_some_and(|e| e.due.0 <= now) {
            if let Some(e) = self.timers.pop() {
                self.fired.push_back(e);
            }
        }
        if !self.forwards.is_empty() {
            let mut late: Vec<ForwardTag> = self
                .forwards
                .iter()
                .filter(|(_, p)| p.deadline <= now)
                .map(|(t, _)| *t)
                .collect();
            late.sort_unstable();
            for t in late {
                if let Some(p) = self.forwards.remove(&t) {
                    self.reply(
                        p.reply_to,
                        Status::TimedOut,
                        b"no reply from the home node".to_vec(),
                    );
                }
            }
        }
    }

    // ----- outputs -----

    /// The next output, or `None` when there is nothing to do (see the
    /// module doc for the order). `now` is the time the outputs are carried
    /// out at (a forward's deadline is checked against it).
    pub fn poll_output(&mut self, now: Duration) -> Option<DataOutput> {
        loop {
            if let Some(o) = self.out.pop_front() {
                return Some(o);
            }
            let mut effect = None;
            for (i, h) in self.types.iter_mut().enumerate() {
                if let Some(e) = h.region.poll_effect() {
                    effect = Some((TypeIdx(i), e));
                    break;
                }
            }
            match effect {
                Some((ty, e)) => {
                    if let Some(o) = self.interpret(now, ty, e) {
                        return Some(o);
                    }
                }
                None => {
                    if std::mem::take(&mut self.check_due) {
                        self.check_registered();
                        continue;
                    }
                    return self.fired.pop_front().map(|e| DataOutput::TimerFired {
                        ty: e.ty,
                        entity: e.entity,
                        key: e.key,
                        incarnation: e.incarnation,
                    });
                }
            }
        }
    }

    /// Turns one region effect into an output (or into more effects and
    /// queued outputs).
    fn interpret(
        &mut self,
        now: Duration,
        ty: TypeIdx,
        eff: RegionEffect<bytes::Bytes, ReplyTo>,
    ) -> Option<DataOutput> {
        self.check_due = true;
        match eff {
            RegionEffect::SendToCoordinator(msg) => {
                Some(DataOutput::ToControl(ToControl::ToCoordinator {
                    type_name: self.types[ty.0].name.clone(),
                    msg,
                }))
            }
            RegionEffect::SendToRegion { to, msg } => {
                if to == self.config.me {
                    self.types[ty.0].region.handle_region_msg(now, msg);
                    None
                } else {
                    Some(DataOutput::ToControl(ToControl::ToRegion {
                        type_name: self.types[ty.0].name.clone(),
                        to,
                        msg,
                    }))
                }
            }
            RegionEffect::Forward { to, envelope } => {
                let t = compact_str::CompactString::from(self.types[ty.0].name.as_str());
                if to.member == self.config.me.member {
                    self.forward_local(&t, to.core, envelope);
                } else {
                    self.forward_remote(now, t, to, envelope);
                }
                None
            }
            RegionEffect::Deliver { envelope, .. } | RegionEffect::NotActive { envelope } => {
                Some(DataOutput::Deliver { ty, envelope })
            }
            RegionEffect::StartEntity { shard, entity } => {
                Some(DataOutput::StartEntity { ty, shard, entity })
            }
            RegionEffect::StopEntity {
                shard,
                entity,
                stop_message,
                reason,
            } => Some(DataOutput::StopEntity {
                ty,
                shard,
                entity,
                stop_message,
                reason,
            }),
            RegionEffect::Persist(event) => Some(DataOutput::Persist { ty, event }),
            RegionEffect::RecoverRememberedEntities { shard } => {
                Some(DataOutput::RecoverRememberedEntities { ty, shard })
            }
            RegionEffect::Fail { envelope, reason } => {
                let status = match reason {
                    FailureReason::ShuttingDown => Status::ShuttingDown,
                    FailureReason::BufferFull => Status::BufferFull,
                    _ => Status::Unavailable,
                };
                Some(DataOutput::Reply {
                    to: envelope.sender,
                    status,
                    payload: reason.to_string().into_bytes(),
                })
            }
        }
    }

    fn reply(&mut self, to: ReplyTo, status: Status, payload: Vec<u8>) {
        self.out.push_back(DataOutput::Reply {
            to,
            status,
            payload,
        });
    }

    /// Opens a data lane to every other node's region that is home to a
    /// shard of a hosted type, once every region knows every shard's home
    /// (warm allocation): the first requests forwarded after the node
    /// reports ready then find their lane connected instead of waiting for
    /// a connect and handshake. Lanes already open or backing off are left
    /// alone; a lane that fails is retried on demand, as always.
    fn open_home_links(&mut self) {
        let mut homes: Vec<RegionId> = Vec::new();
        for h in &self.types {
            for r in h.region.home_regions() {
                if r.member != self.config.me.member && !homes.contains(&r) {
                    homes.push(r);
                }
            }
        }
        homes.sort_by(|a, b| (&*a.member.address.0, a.core).cmp(&(&*b.member.address.0, b.core)));
        for r in homes {
            if self.links.contains(&r)
                || self.backoff.contains_key(&r)
                || self.removed.contains(&r.member)
            {
                continue;
            }
            self.links.insert(r.clone());
            self.out.push_back(DataOutput::OpenLink { to: r });
        }
    }

    /// The registration and hand-off reports for the control executor:
    /// whether every region is registered and (with warm allocation)
    /// whether every region knows the home of every shard.
    fn check_registered(&mut self) {
        let all = !self.types.is_empty() && self.types.iter().all(|h| h.region.is_registered());
        let n = self.config.number_of_shards as usize;
        let warm =
            !self.config.warm_allocation || self.types.iter().all(|h| h.region.known_homes() >= n);
        if (all, warm) != self.reported_registered {
            if all && warm && self.config.warm_allocation {
                self.open_home_links();
            }
            self.reported_registered = (all, warm);
            self.out
                .push_back(DataOutput::ToControl(ToControl::Registered {
                    core: self.config.me.core,
                    all,
                    warm,
                }));
        }
        if self.shutting_down && !self.reported_shutdown {
            let done = self
                .types
                .iter()
                .all(|h| h.region.is_proxy() || h.region.is_shutdown_complete());
            if done {
                self.reported_shutdown = true;
                self.out
                    .push_back(DataOutput::ToControl(ToControl::ShutdownComplete {
                        core: self.config.me.core,
                    }));
            }
        }
    }

    /// A message for another core of this node: a system message travels
    /// with its sender (unanswered); any other waits for the core's answer
    /// under a [`LocalToken`].
    fn forward_local(&mut self, t: &str, to_core: u16, env: UserEnvelope) {
        if matches!(env.sender, ReplyTo::System(_)) {
            self.out.push_back(DataOutput::ToCore {
                core: to_core,
                type_name: t.into(),
                envelope: env,
            });
            return;
        }
        let token = self.next_local;
        self.next_local += 1;
        let fwd = Envelope {
            deadline: env.deadline,
            entity: env.entity,
            shard: env.shard,
            sender: ReplyTo::Core {
                core: self.config.me.core,
                token,
            },
            payload: env.payload,
        };
        self.local_forwards.insert(LocalToken(token), env.sender);
        self.out.push_back(DataOutput::ToCore {
            core: to_core,
            type_name: t.into(),
            envelope: fwd,
        });
    }

    /// A message for another node's region: over its data lane (opened
    /// first), or answered at once (member removed, lane backing off,
    /// deadline passed).
    fn forward_remote(
        &mut self,
        now: Duration,
        t: compact_str::CompactString,
        to: RegionId,
        env: UserEnvelope,
    ) {
        if self.removed.contains(&to.member) {
            return self.reply(
                env.sender,
                Status::Unavailable,
                b"home node was removed from the cluster".to_vec(),
            );
        }
        if !self.links.contains(&to) {
            if let Some(b) = self.backoff.get(&to) {
                if now < b.until {
                    return self.reply(
                        env.sender,
                        Status::Unavailable,
                        b"home node unreachable; retry later".to_vec(),
                    );
                }
            }
            self.links.insert(to.clone());
            self.out.push_back(DataOutput::OpenLink { to: to.clone() });
        }
        if let ReplyTo::System(m) = &env.sender {
            let (kind, peer, reason) = m.to_wire();
            let frame = DataFrame::System {
                type_name: t.to_string(),
                entity_id: env.entity.as_str().into(),
                shard: env.shard.0,
                kind,
                peer_type: peer.type_name.clone(),
                peer_id: peer.id.as_str().to_string(),
                reason,
            };
            self.out
                .push_back(DataOutput::Transmit(Transmit { to, frame }));
            return;
        }
        let (deadline_ms, wait_until) = match env.deadline {
            Some(d) if d <= now => {
                // Defensive: the region checks this before it forwards.
                return self.reply(
                    env.sender,
                    Status::Unavailable,
                    b"ask deadline passed before the message was sent; not delivered".to_vec(),
                );
            }
            Some(d) => {
                let left = u32::try_from((d - now).as_millis()).unwrap_or(u32::MAX);
                (left.max(1), d + FORWARD_GRACE)
            }
            None => (0, now + FORWARD_TIMEOUT),
        };
        let tag = self.next_forward;
        self.next_forward += 1;
        let frame = DataFrame::Forward {
            tag,
            type_name: t,
            entity_id: env.entity.as_str().into(),
            shard: env.shard.0,
            payload: env.payload,
            deadline_ms,
        };
        self.forwards.insert(
            ForwardTag(tag),
            PendingForward {
                reply_to: env.sender,
                link: to.clone(),
                deadline: wait_until,
            },
        );
        self.out
            .push_back(DataOutput::Transmit(Transmit { to, frame }));
    }
}

/// Gives a payload its own bytes, so that a message that waits (see
/// [`ShardRegion::set_buffer_hook`], and a stateless worker's queue) does
/// not keep its connection's receive buffer alive.
pub(crate) fn detach_payload(p: &mut bytes::Bytes) {
    *p = bytes::Bytes::copy_from_slice(p);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{encode_frame, FRAME_HEADER_BYTES};
    use shardline_core::ids::{Address, MemberUid};
    use shardline_core::sharding::{CoordinatorMsg, Generation};

    const T: &str = "counter";

    fn member(port: u16, uid: u64) -> UniqueAddress {
        UniqueAddress {
            address: Address(format!("127.0.0.1:{port}").into()),
            uid: MemberUid(uid),
        }
    }

    fn me() -> RegionId {
        RegionId {
            member: member(7101, 1),
            core: 0,
        }
    }

    fn remote() -> RegionId {
        RegionId {
            member: member(7102, 2),
            core: 1,
        }
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// A plane with one registered entity type (`idle`: its passivation
    /// idle timeout); its registration outputs drained.
    fn plane(idle: Option<Duration>) -> (DataPlane, TypeIdx) {
        let mut p = DataPlane::new(DataPlaneConfig {
            me: me(),
            number_of_shards: 16,
            ask_timeout: secs(5),
            max_message_size_bytes: 1024,
            warm_allocation: false,
        });
        let settings = RegionSettings {
            passivation: PassivationSettings {
                idle_timeout: idle,
                active_entity_limit: None,
            },
            ..RegionSettings::default()
        };
        let ty = p
            .handle_register_type(Duration::ZERO, T, settings, true, false)
            .expect("new type");
        assert!(p
            .handle_register_type(Duration::ZERO, T, RegionSettings::default(), true, false)
            .is_none());
        let registered = |out: &[DataOutput], all: bool| {
            out.iter().any(|o| {
                matches!(o, DataOutput::ToControl(ToControl::Registered { core: 0, all: a, .. }) if *a == all)
            })
        };
        let out = drain(&mut p, Duration::ZERO);
        assert!(
            registered(&out, false),
            "a new type is reported unregistered"
        );
        p.handle_region_msg(Duration::ZERO, T, RegionMsg::RegisterAck);
        let out = drain(&mut p, Duration::ZERO);
        assert!(registered(&out, true), "the registration is reported");
        (p, ty)
    }

    fn drain(p: &mut DataPlane, now: Duration) -> Vec<DataOutput> {
        std::iter::from_fn(|| p.poll_output(now)).collect()
    }

    fn id(s: &str) -> EntityId {
        EntityId::new(s).expect("entity id")
    }

    /// Makes `home` the home of the shard of `entity`.
    fn home(p: &mut DataPlane, now: Duration, entity: &str, home: RegionId) -> Vec<DataOutput> {
        let shard = p.shard_of(&id(entity));
        p.handle_region_msg(
            now,
            T,
            RegionMsg::ShardHome {
                shard,
                region: home,
                generation: Generation(1),
            },
        );
        drain(p, now)
    }

    fn client_replies(out: &[DataOutput]) -> Vec<(u64, u64, Status, Vec<u8>)> {
        out.iter()
            .filter_map(|o| match o {
                DataOutput::Reply {
                    to: ReplyTo::Client { conn, request_id },
                    status,
                    payload,
                } => Some((*conn, *request_id, *status, payload.clone())),
                _ => None,
            })
            .collect()
    }

    fn delivered(out: Vec<DataOutput>) -> Vec<UserEnvelope> {
        out.into_iter()
            .filter_map(|o| match o {
                DataOutput::Deliver { envelope, .. } => Some(envelope),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn local_request_is_delivered_and_its_reply_waits_until_durable() {
        let (mut p, _) = plane(None);
        let now = secs(1);
        home(&mut p, now, "a", me());
        p.handle_client_request(
            now,
            7,
            1,
            T.as_bytes(),
            b"a",
            bytes::Bytes::from_static(b"inc"),
        );
        let out = drain(&mut p, now);
        assert!(client_replies(&out).is_empty(), "nothing answered yet");
        let envs = delivered(out);
        assert_eq!(envs.len(), 1, "delivered once");
        let env = envs.into_iter().next().expect("delivery");
        assert_eq!(env.entity, id("a"));
        assert_eq!(env.payload, b"inc".as_slice());
        assert_eq!(env.deadline, Some(now + secs(5)), "the ask deadline");
        assert_eq!(
            env.sender,
            ReplyTo::Client {
                conn: 7,
                request_id: 1
            }
        );
        // The entity persisted events: its reply waits for them.
        p.handle_reply_deferred(42, 1, env.sender);
        assert!(p.poll_reply().is_none(), "held until durable");
        assert!(drain(&mut p, now).is_empty());
        assert!(
            !p.handle_reply_durable(41, Status::Ok, Vec::new()),
            "unknown token"
        );
        assert!(p.poll_reply().is_none());
        // Durable: released once, to the client.
        assert!(p.handle_reply_durable(42, Status::Ok, b"1".to_vec()));
        let r = p.poll_reply().expect("released");
        assert_eq!(
            r.to,
            ReplyTo::Client {
                conn: 7,
                request_id: 1
            }
        );
        assert_eq!((r.status, r.payload.as_slice()), (Status::Ok, &b"1"[..]));
        assert!(p.poll_reply().is_none());
        assert!(
            !p.handle_reply_durable(42, Status::Ok, b"1".to_vec()),
            "once"
        );
        // A reply still held when its incarnation stops fails.
        p.handle_reply_deferred(43, 1, ReplyTo::Api { id: 9 });
        p.handle_reply_deferred(44, 2, ReplyTo::Api { id: 10 });
        p.handle_incarnation_stopped(1);
        let r = p.poll_reply().expect("failed");
        assert_eq!(
            (r.to, r.status),
            (ReplyTo::Api { id: 9 }, Status::EntityFailed)
        );
        assert!(
            p.poll_reply().is_none(),
            "the other incarnation's reply still waits"
        );
    }

    #[test]
    fn bad_requests_are_answered_at_once() {
        let (mut p, _) = plane(None);
        let now = secs(1);
        p.handle_client_request(now, 1, 1, b"nope", b"a", bytes::Bytes::new());
        p.handle_client_request(now, 1, 2, T.as_bytes(), b"", bytes::Bytes::new());
        p.handle_client_request(
            now,
            1,
            3,
            T.as_bytes(),
            b"a",
            bytes::Bytes::from(vec![0; 1025]),
        );
        let out = drain(&mut p, now);
        let statuses: Vec<(u64, Status)> = client_replies(&out)
            .into_iter()
            .map(|(_, r, s, _)| (r, s))
            .collect();
        assert_eq!(
            statuses,
            vec![
                (1, Status::UnknownEntityType),
                (2, Status::InvalidEntityId),
                (3, Status::TooLarge)
            ]
        );
        assert_eq!(p.handle_stop(), 0);
        p.handle_client_request(now, 1, 4, T.as_bytes(), b"a", bytes::Bytes::new());
        let out = drain(&mut p, now);
        assert_eq!(client_replies(&out)[0].2, Status::ShuttingDown);
    }

    #[test]
    fn a_warm_plane_opens_a_lane_to_every_remote_home_once_all_homes_are_known() {
        let mut p = DataPlane::new(DataPlaneConfig {
            me: me(),
            number_of_shards: 4,
            ask_timeout: secs(5),
            max_message_size_bytes: 1024,
            warm_allocation: true,
        });
        p.handle_register_type(Duration::ZERO, T, RegionSettings::default(), true, false)
            .expect("new type");
        p.handle_region_msg(Duration::ZERO, T, RegionMsg::RegisterAck);
        drain(&mut p, Duration::ZERO);
        let third = RegionId {
            member: member(7103, 3),
            core: 0,
        };
        let homes = [remote(), remote(), me(), third.clone()];
        let lanes = |out: &[DataOutput]| -> Vec<RegionId> {
            out.iter()
                .filter_map(|o| match o {
                    DataOutput::OpenLink { to } => Some(to.clone()),
                    _ => None,
                })
                .collect()
        };
        let now = secs(1);
        for (n, region) in homes.iter().enumerate() {
            p.handle_region_msg(
                now,
                T,
                RegionMsg::ShardHome {
                    shard: ShardId(n as u32),
                    region: region.clone(),
                    generation: Generation(1),
                },
            );
            let out = drain(&mut p, now);
            if n + 1 < homes.len() {
                assert!(
                    lanes(&out).is_empty(),
                    "a lane opened before every home was known"
                );
                continue;
            }
            assert_eq!(
                lanes(&out),
                vec![remote(), third.clone()],
                "one lane per remote home"
            );
            assert!(out.iter().any(|o| matches!(
                o,
                DataOutput::ToControl(ToControl::Registered { warm: true, .. })
            )));
        }
        // A request forwarded to a home whose lane is open opens no other.
        let entity = (0..1000)
            .map(|i| format!("e{i}"))
            .find(|e| p.shard_of(&id(e)) == ShardId(0))
            .expect("an entity of shard 0");
        p.handle_client_request(
            now,
            7,
            1,
            T.as_bytes(),
            entity.as_bytes(),
            bytes::Bytes::from_static(b"ping"),
        );
        let out = drain(&mut p, now);
        assert!(lanes(&out).is_empty(), "a second lane to the same region");
        assert!(out
            .iter()
            .any(|o| matches!(o, DataOutput::Transmit(t) if t.to == remote())));
    }

    #[test]
    fn unknown_shard_asks_the_coordinator_then_forwards_when_the_home_arrives() {
        let (mut p, _) = plane(None);
        let now = secs(1);
        let shard = p.shard_of(&id("b"));
        p.handle_client_request(
            now,
            7,
            1,
            T.as_bytes(),
            b"b",
            bytes::Bytes::from_static(b"ping"),
        );
        let out = drain(&mut p, now);
        let asked = out.iter().any(|o| {
            matches!(o, DataOutput::ToControl(ToControl::ToCoordinator {
                type_name,
                msg: CoordinatorMsg::GetShardHome { shard: s, .. },
            }) if type_name == T && *s == shard)
        });
        assert!(asked, "asks the coordinator for the home");
        assert!(
            out.iter().all(|o| !matches!(
                o,
                DataOutput::Transmit(_) | DataOutput::Deliver { .. } | DataOutput::Reply { .. }
            )),
            "buffered: neither sent nor answered"
        );
        // The home is another node: a lane opens and the message goes.
        let later = now + Duration::from_millis(200);
        let out = home(&mut p, later, "b", remote());
        let mut it = out.into_iter();
        assert!(matches!(it.next(), Some(DataOutput::OpenLink { to }) if to == remote()));
        let Some(DataOutput::Transmit(t)) = it.next() else {
            panic!("the buffered message is forwarded");
        };
        assert_eq!(t.to, remote());
        let DataFrame::Forward {
            tag,
            type_name,
            entity_id,
            shard: s,
            payload,
            deadline_ms,
        } = t.frame
        else {
            panic!("a Forward frame");
        };
        assert_eq!(
            (type_name.as_str(), entity_id.as_str(), s, &payload[..]),
            (T, "b", shard.0, &b"ping"[..])
        );
        assert_eq!(deadline_ms, 4800, "the time left of the ask deadline");
        assert!(it.all(|o| !matches!(o, DataOutput::Transmit(_))));
        assert!(
            p.poll_timeout().is_some(),
            "the forward waits for its reply"
        );
        // Its reply answers the client.
        let mut buf = Vec::new();
        encode_frame(
            &DataFrame::Reply {
                tag,
                status: Status::Ok as u8,
                payload: b"pong".to_vec(),
            },
            &mut buf,
        )
        .expect("encode");
        p.handle_link_frame(&buf[FRAME_HEADER_BYTES..], Vec::new())
            .expect("a reply frame");
        let out = drain(&mut p, later);
        assert_eq!(
            client_replies(&out),
            vec![(7, 1, Status::Ok, b"pong".to_vec())]
        );
        // A second message uses the open lane.
        p.handle_client_request(
            later,
            7,
            2,
            T.as_bytes(),
            b"b",
            bytes::Bytes::from_static(b"again"),
        );
        let out = drain(&mut p, later);
        assert!(matches!(out.as_slice(), [DataOutput::Transmit(_)]));
        // The lane breaks after it connected: the sender hears TimedOut.
        p.handle_link_closed(later, &remote(), true, true);
        let out = drain(&mut p, later);
        assert_eq!(client_replies(&out)[0].2, Status::TimedOut);
    }

    #[test]
    fn forwards_failed_together_are_answered_in_the_order_they_were_sent() {
        // The forwards wait in a map with a per-process random seed: a
        // lane that breaks, deadlines that pass together and the stop
        // drain answer them in the order they were sent, not the map's.
        let ids: Vec<u64> = (0..32).collect();
        let send = |p: &mut DataPlane, now: Duration, first: u64| {
            for i in &ids {
                p.handle_client_request(now, 7, first + i, T.as_bytes(), b"b", bytes::Bytes::new());
            }
            drain(p, now)
        };
        let answered = |out: &[DataOutput]| -> Vec<u64> {
            client_replies(out)
                .into_iter()
                .map(|(_, r, _, _)| r)
                .collect()
        };
        let (mut p, _) = plane(None);
        let now = secs(1);
        home(&mut p, now, "b", remote());
        send(&mut p, now, 0);
        p.handle_link_closed(now, &remote(), true, true);
        assert_eq!(answered(&drain(&mut p, now)), ids, "a broken lane");
        // After the backoff: a new lane; the deadlines pass together.
        let later = now + secs(3);
        send(&mut p, later, 100);
        let late = later + secs(10);
        p.handle_timeout(late);
        let want: Vec<u64> = ids.iter().map(|i| 100 + i).collect();
        assert_eq!(answered(&drain(&mut p, late)), want, "deadlines");
        send(&mut p, late, 200);
        p.handle_drain_end();
        let want: Vec<u64> = ids.iter().map(|i| 200 + i).collect();
        assert_eq!(answered(&drain(&mut p, late)), want, "the stop drain");
    }

    #[test]
    fn hand_off_stops_the_entities_then_answers_shard_stopped() {
        let (mut p, ty) = plane(None);
        let now = secs(1);
        home(&mut p, now, "a", me());
        p.handle_client_request(
            now,
            7,
            1,
            T.as_bytes(),
            b"a",
            bytes::Bytes::from_static(b"inc"),
        );
        assert_eq!(delivered(drain(&mut p, now)).len(), 1);
        let shard = p.shard_of(&id("a"));
        p.handle_region_msg(
            now,
            T,
            RegionMsg::HandOff {
                shard,
                generation: Generation(1),
            },
        );
        let out = drain(&mut p, now);
        let stops: Vec<(&EntityId, StopReason)> = out
            .iter()
            .filter_map(|o| match o {
                DataOutput::StopEntity { entity, reason, .. } => Some((entity, *reason)),
                _ => None,
            })
            .collect();
        assert_eq!(stops, vec![(&id("a"), StopReason::HandOff)]);
        let stopped = |out: &[DataOutput]| {
            out.iter().any(|o| {
                matches!(o, DataOutput::ToControl(ToControl::ToCoordinator {
                    msg: CoordinatorMsg::ShardStopped { shard: s, .. }, ..
                }) if *s == shard)
            })
        };
        assert!(!stopped(&out), "not before its entities stopped");
        p.handle_entity_stopped(now, ty, shard, &id("a"));
        let out = drain(&mut p, now);
        assert!(stopped(&out), "ShardStopped once they did");
    }

    #[test]
    fn entity_timers_fire_once_when_due_and_can_be_cancelled() {
        let (mut p, ty) = plane(None);
        let a = id("a");
        let fired = |p: &mut DataPlane, at: Duration| -> Vec<(u64, u64)> {
            p.handle_timeout(at);
            drain(p, at)
                .into_iter()
                .filter_map(|o| match o {
                    DataOutput::TimerFired {
                        entity,
                        key,
                        incarnation,
                        ..
                    } if entity == id("a") => Some((key, incarnation)),
                    _ => None,
                })
                .collect()
        };
        p.handle_entity_timers(
            secs(1),
            ty,
            &a,
            3,
            vec![(1, Some(secs(2))), (2, Some(secs(1)))],
        );
        assert!(p.poll_timeout().is_some_and(|d| d <= secs(2)));
        // Timer 2 is armed again later, timer 1 is cancelled.
        p.handle_entity_timers(secs(1), ty, &a, 3, vec![(2, Some(secs(5)))]);
        p.handle_entity_timers(secs(1), ty, &a, 3, vec![(1, None)]);
        assert!(fired(&mut p, secs(5)).is_empty(), "none due yet");
        assert_eq!(fired(&mut p, secs(6)), vec![(2, 3)]);
        assert!(fired(&mut p, secs(60)).is_empty(), "fired once");
    }

    #[test]
    fn passivation_timeout_stops_an_idle_entity() {
        let (mut p, _) = plane(Some(secs(2)));
        let now = secs(1);
        home(&mut p, now, "a", me());
        p.handle_client_request(
            now,
            7,
            1,
            T.as_bytes(),
            b"a",
            bytes::Bytes::from_static(b"inc"),
        );
        assert_eq!(delivered(drain(&mut p, now)).len(), 1);
        assert!(p.poll_timeout().is_some(), "an idle timer");
        // Not idle long enough yet.
        p.handle_timeout(now + secs(1));
        let out = drain(&mut p, now + secs(1));
        assert!(out
            .iter()
            .all(|o| !matches!(o, DataOutput::StopEntity { .. })));
        let late = now + secs(4);
        p.handle_timeout(late);
        let out = drain(&mut p, late);
        assert!(
            out.iter().any(|o| matches!(
                o,
                DataOutput::StopEntity { entity, reason: StopReason::IdleTimeout, .. }
                    if *entity == id("a")
            )),
            "the idle entity is stopped"
        );
    }
}
