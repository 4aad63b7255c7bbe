//! The entity host: the part of a data core that runs the entities' code,
//! beside the [`DataPlane`] that routes their messages.
//!
//! [`EntityHost`] runs a core's entities (one [`TypeIdx`] per entity
//! type, in the plane's order): each running incarnation ([`Live`]) is kept
//! in its entity's entry of the region's table (one table per shard,
//! [`super::data::EntitySlot`]): one copy of its id, and the host's lookup
//! of a delivered message's entity finds the entry the region's routing
//! just touched (in cache). The host owns the incarnation counter, the
//! stateless worker pools, the entities' asks to other entities and their timeouts,
//! the lifecycle watches (`node::watch`), the incarnations stopping after
//! their journal appends, and the reads of remembered entities. Entities
//! run inside it as an actor's `receive` runs in Akka: user code, with no
//! I/O of ours. Everything a handler asked (the one harvest of an
//! [`EntityContext`], applied in one place) becomes either an input of the
//! plane (a reply held by the durability barrier, timers, passivation, a
//! stop) or a [`HostOutput`] for the driver (a reply, a message to another
//! entity). There is no clock (time comes in as `now`, the core's
//! monotonic clock), no socket and no thread-local: the core's journal
//! ([`crate::persistence::CoreJournal`], which the driver opens and hands
//! over with [`EntityHost::set_journal`]), the core's ask ids and the
//! deferred replies' completions are the host's, lent to each entity call
//! ([`EntityServices`]); the remembered-entity reads and records and the
//! durability wait use the same journal.
//!
//! # Order of calls
//!
//! The driver drains [`DataPlane::poll_output`] and hands each output to
//! [`EntityHost::handle_plane_output`]: the host takes the entities' ones
//! ([`DataOutput::Deliver`], `StartEntity`, `StopEntity`, `TimerFired`,
//! `ToWorker`, `Persist`, `RecoverRememberedEntities`, and replies to a
//! system message or to an entity's ask) and gives back the others for the
//! driver to carry out. After each output (and after every other
//! `handle_*` call of the host) the driver drains [`EntityHost::poll_output`],
//! then keeps draining the plane, whose queue the host may have fed. When
//! both are empty, [`EntityHost::take_system`] gives the lifecycle
//! messages to route (through [`DataPlane::handle_message`], like user
//! messages). [`EntityHost::handle_timeout`] runs the asks' timeouts, the
//! remembered-entity read retries and the worker pools' timers; the driver
//! calls it when [`EntityHost::poll_timeout`] passes, and on every tick
//! while [`EntityHost::has_workers`] (the pools are checked on each call).
//!
//! A caller without the host (the simulation, the plane's own tests) keeps
//! using the plane's entity outputs directly.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::rc::Rc;
use std::time::Duration;

use shardline_core::ids::{EntityId, ShardId, UniqueAddress};
use shardline_core::sharding::{shard_id_of, Envelope, StopReason};

use super::data::{DataOutput, DataPlane, TypeIdx};
use crate::entity::worker::WorkerSettings;
use crate::entity::{
    catch_panic, AskId, Entity, EntityAskError, EntityContext, EntityError, EntityFactory,
    EntityServices, Outgoing, TerminatedReason, WatchCommand,
};
use crate::envelope::Status;
use crate::node::msg::{ReplyTo, UserEnvelope};
use crate::node::watch::{EntityKey, SystemMsg, WatchBook};
use crate::status::WorkerPoolStatus;
use crate::FastMap;

mod workers;

/// The token under which a handler's reply can be deferred
/// ([`EntityContext::defer_reply`]) until the journal made its events
/// durable; one id space per core, distinct from the ask ids of entities
/// ([`AskId`]) and from the driver's API ask ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ReplyToken(pub u64);

/// First delay before a failed read of remembered entities is retried.
const REMEMBER_RETRY_MIN: Duration = Duration::from_millis(100);
/// Largest delay before a failed read of remembered entities is retried.
const REMEMBER_RETRY_MAX: Duration = Duration::from_secs(2);
/// Most rounds of lifecycle messages [`EntityHost::take_system`] gives out
/// per input (count); the rest waits for the next input or tick.
pub(crate) const SYSTEM_ROUNDS: usize = 16;

/// What an [`EntityHost`] is built from.
#[derive(Debug, Clone)]
pub(crate) struct HostConfig {
    /// This core's index.
    pub core: u16,
    /// The node's data cores (count, at least 1).
    pub cores: usize,
    /// `number_of_shards` of the cluster (count, at least 1).
    pub number_of_shards: u32,
    /// `requests.ask_timeout_ms`: the longest ask deadline of a message an
    /// entity asks with.
    pub ask_timeout: Duration,
    /// `requests.max_message_size_bytes`: the longest message an entity
    /// may send (tell, ask, forward), wherever its target lives.
    pub max_message_size_bytes: u64,
}

impl HostConfig {
    /// The host's settings from a node's configuration.
    pub(crate) fn from_node_config(
        config: &crate::config::NodeConfig,
        core: u16,
        cores: usize,
    ) -> Self {
        HostConfig {
            core,
            cores: cores.max(1),
            number_of_shards: config.number_of_shards,
            ask_timeout: config.requests.ask_timeout(),
            max_message_size_bytes: config.requests.max_message_size_bytes,
        }
    }
}

/// What the driver carries out for the host ([`EntityHost::poll_output`]).
#[derive(Debug)]
pub(crate) enum HostOutput {
    /// Answer a message's sender (never a system message; an entity's ask
    /// goes back through this core's inbox, so that the asker's handler
    /// never runs inside another's).
    Reply {
        /// Who is answered.
        to: ReplyTo,
        /// The answer's status.
        status: Status,
        /// The answer's bytes (a reason for a failure).
        payload: Vec<u8>,
    },
    /// A message an entity sent (tell, forward, ask): route it through this
    /// core's own inbox ([`DataPlane::handle_message`] once it is taken
    /// from there). If the inbox refuses it, answer its sender
    /// `BufferFull`.
    Send {
        /// The target's entity type.
        type_name: String,
        /// The message.
        envelope: UserEnvelope,
    },
}

/// The counters of one entity type on this core (`shardline status`).
#[derive(Debug, Clone, Default)]
pub(crate) struct TypeFigures {
    /// Active entities (count).
    pub entities: usize,
    /// Messages handed to the type's entities (count).
    pub delivered: u64,
    /// Incarnations started (count).
    pub activated: u64,
    /// The worker pool's figures of a stateless worker type.
    pub worker: Option<WorkerPoolStatus>,
}

struct TypeHost {
    name: Rc<str>,
    factory: Option<EntityFactory>,
    /// Incarnations of the type running here (count); they live in their
    /// region's entity table ([`super::data::EntitySlot`]).
    live: usize,
    delivered: u64,
    activated: u64,
    /// `Some` for a stateless worker type: its requests bypass the region.
    worker: Option<workers::WorkerHost>,
}

/// A running incarnation of an entity: kept in its entry of the region's
/// entity table ([`super::data::EntitySlot`]), beside the region's state
/// of it, under the one copy of its id (32 bytes).
pub struct Live {
    /// Dropped by [`Live`]'s `Drop`, which catches a panic of the
    /// entity's own `Drop`.
    entity: std::mem::ManuallyDrop<Box<dyn Entity>>,
    incarnation: u64,
    /// The shard's allocation generation when the entity started (the
    /// writer epoch of its journal appends).
    epoch: u64,
}

impl Drop for Live {
    fn drop(&mut self) {
        // SAFETY: `entity` is taken once, here, and `self` is not used
        // afterwards.
        let entity = unsafe { std::mem::ManuallyDrop::take(&mut self.entity) };
        drop_entity(entity, "", None);
    }
}

/// Drops entity `e` of type `type_name` (id `id` when known), catching a
/// panic of its own `Drop`, which is logged.
pub(crate) fn drop_entity(e: Box<dyn Entity>, type_name: &str, id: Option<&EntityId>) {
    if let Err(why) = catch_panic(move || drop(e)) {
        entity_panicked(type_name, id, "drop", &why);
    }
}

/// The outcome of `callback`, a call of entity `id`'s code run under
/// [`catch_panic`]: a panic is logged and becomes the error the call
/// fails with (`<callback> panicked: <message>`), as if it had returned it.
pub(crate) fn panic_as_error(
    type_name: &str,
    id: Option<&EntityId>,
    callback: &str,
    res: Result<Result<(), EntityError>, String>,
) -> Result<(), EntityError> {
    res.unwrap_or_else(|why| {
        entity_panicked(type_name, id, callback, &why);
        Err(EntityError::Failed(format!("{callback} panicked: {why}")))
    })
}

/// Logs (WARN, at most one line per [`crate::runtime::log_limit::LOG_WINDOW_MS`]
/// for every entity of the process) that `callback` of entity `id` of
/// type `type_name` panicked with message `why`: the data core caught it
/// and goes on (see [`crate::entity::Entity::handle`]).
pub(crate) fn entity_panicked(type_name: &str, id: Option<&EntityId>, callback: &str, why: &str) {
    let entity = id.map_or("", EntityId::as_str);
    crate::runtime::limited!(
        warn,
        entity_type = type_name,
        entity,
        callback,
        panic = why,
        "entity code panicked; the data core caught it and failed the incarnation"
    );
}

/// The incarnation (or worker activation) of an entity whose factory or
/// `on_start` panicked: every message it gets fails with the text it
/// holds. An incarnation is failed at once like any failed incarnation
/// (its sender answered `EntityFailed`, its region told it stopped); a
/// worker activation fails its first request and is replaced.
pub(super) struct StartFailed(pub(super) String);

impl Entity for StartFailed {
    fn handle(&mut self, _ctx: &mut EntityContext<'_>, _message: &[u8]) -> Result<(), EntityError> {
        Err(EntityError::Failed(self.0.clone()))
    }
}

/// Incarnation `inc` of entity `id` of `ty`, with its shard, while it runs
/// here; `None` once it stopped (or another incarnation runs).
fn running_incarnation<'p>(
    plane: &'p mut DataPlane,
    ty: TypeIdx,
    id: &EntityId,
    inc: u64,
) -> Option<(ShardId, &'p mut Live)> {
    let shard = plane.shard_of(id);
    let live = plane.entity_slot_mut(ty, shard, id)?.as_mut()?;
    (live.incarnation == inc).then_some((shard, live))
}

/// What [`EntityHost::ensure_entity`] found.
enum Ensured {
    /// The entity runs here (it was started if need be).
    Running,
    /// The type hosts no entities on this core (a proxy, or unknown).
    NotHosted,
    /// The entity is not live and its shard does not run here (now).
    NotLive,
    /// Its factory or `on_start` panicked: the incarnation was failed at
    /// once (the text says why).
    Failed(String),
}

/// An incarnation a handler ran on: what its harvest applies to.
struct Incarnation {
    ty: TypeIdx,
    id: EntityId,
    shard: ShardId,
    inc: u64,
}

/// What a handler asked of the runtime, taken from its context once.
struct Harvest {
    outgoing: Vec<Outgoing>,
    timers: Vec<(u64, Option<Duration>)>,
    passivate: bool,
    durable: bool,
    watches: Vec<WatchCommand>,
    failed: bool,
    /// The call panicked (logged where it was caught, rate-limited).
    panicked: bool,
}

impl Harvest {
    /// Takes what the handler run with `ctx` asked.
    fn of(ctx: &mut EntityContext<'_>) -> Self {
        Harvest {
            outgoing: ctx.take_outgoing(),
            timers: ctx.take_timers(),
            passivate: ctx.wants_passivation(),
            durable: ctx.wants_durable(),
            watches: ctx.take_watches(),
            failed: ctx.wants_failed_stop(),
            panicked: false,
        }
    }

    /// Takes what the handler run with `ctx` asked; `res` is its outcome
    /// (`Err` with the message of a panic of the call, which is logged
    /// here and becomes the call's [`EntityError`], as if it had failed).
    fn of_call(
        ctx: &mut EntityContext<'_>,
        callback: &str,
        res: Result<Result<(), EntityError>, String>,
    ) -> (Self, Result<(), EntityError>) {
        let mut h = Harvest::of(ctx);
        h.panicked = res.is_err();
        let res = panic_as_error(ctx.type_name(), Some(ctx.self_id()), callback, res);
        (h, res)
    }
}

/// The reply of a message handler (`Entity::handle`).
struct HandlerReply {
    sender: ReplyTo,
    /// The ask deadline of the message handled (a forward keeps it).
    deadline: Option<Duration>,
    token: ReplyToken,
    payload: Vec<u8>,
    deferred: bool,
}

/// An incarnation being stopped that waits for something to have an
/// outcome (its journal appends, or a recovery read with commands stashed
/// behind it; [`Entity::on_stopping`]): it gets no message, only
/// [`Entity::on_durable`], until it does; then it stops. Past `wait_until`
/// it is asked [`Entity::may_stop_waiting`].
struct Stopping {
    ty: TypeIdx,
    shard: ShardId,
    id: EntityId,
    live: Live,
    reason: TerminatedReason,
    /// Tell the region when it stopped (false when the whole node stops).
    tell_region: bool,
    /// When to ask it whether it may stop without waiting longer (core
    /// clock; moves by [`crate::entity::STOP_WAIT`] each time it says no).
    wait_until: Duration,
}

/// A read of a shard's remembered entities in flight, or waiting to be
/// retried after a failure (the shard waits in `Recovering`, its messages
/// buffered in the region).
struct RememberPending {
    ty: TypeIdx,
    shard: ShardId,
    /// The shard's allocation generation when the read started.
    generation: u64,
    /// The read in flight (`None`: retry at `retry_at`).
    ticket: Option<u64>,
    retry_at: Duration,
    /// Failed reads in a row (count).
    failures: u32,
}

/// An ask of an entity of this core waiting for its answer.
struct EntityAskWait {
    ty: TypeIdx,
    entity: EntityId,
    incarnation: u64,
    /// When the ask times out (core clock): an answer that comes later
    /// (e.g. handled on this core while the timeout could not run) is
    /// turned into `TimedOut`, as the asker was promised.
    due: Duration,
}

/// The entity host of one data core (see the module doc).
pub(crate) struct EntityHost {
    config: HostConfig,
    /// In the order of the plane's [`TypeIdx`].
    types: Vec<TypeHost>,
    next_incarnation: u64,
    next_token: u64,
    /// Asks of this core's entities waiting for their answer.
    entity_asks: FastMap<AskId, EntityAskWait>,
    /// When an entity's ask times out: (due, ask id).
    ask_expiry: BinaryHeap<Reverse<(Duration, AskId)>>,
    /// Lifecycle watches of this core's entities (`node::watch`).
    watches: WatchBook,
    /// Entities awaiting journal durability (and the core's durability
    /// wake, which the driver waits on).
    durable: crate::persistence::Hooks,
    /// What every entity call is lent: the core's journal, ask ids and
    /// answered deferred replies.
    services: EntityServices,
    /// Incarnations stopping after what they wait for (appends in flight,
    /// a recovery read), by incarnation.
    stopping: FastMap<u64, Stopping>,
    /// Reads of remembered entities in flight or waiting for a retry.
    remember_reads: Vec<RememberPending>,
    /// Why the last read of remembered entities failed, while a shard
    /// waits for its retry.
    remember_error: Option<String>,
    out: VecDeque<HostOutput>,
}

impl EntityHost {
    /// A host with no entity types.
    pub(crate) fn new(config: HostConfig) -> Self {
        let core = config.core;
        EntityHost {
            config,
            types: Vec::new(),
            next_incarnation: 1,
            next_token: 1,
            entity_asks: FastMap::default(),
            ask_expiry: BinaryHeap::new(),
            watches: WatchBook::default(),
            durable: crate::persistence::Hooks::default(),
            services: EntityServices::new(core, crate::persistence::CoreJournal::new()),
            stopping: FastMap::default(),
            remember_reads: Vec::new(),
            remember_error: None,
            out: VecDeque::new(),
        }
    }

    // ----- queries -----

    /// The core's durability wake: the driver waits on it and calls
    /// [`EntityHost::handle_durable`] when it fires.
    pub(crate) fn durable_wake(&self) -> std::sync::Arc<crate::persistence::DurableWake> {
        self.durable.wake.clone()
    }

    /// The core's journal (the driver reads its health and durable LSN).
    pub(crate) fn journal(&self) -> &crate::persistence::CoreJournal {
        &self.services.journal
    }

    /// The core's journal, to flush a turn's appends, clear a fired
    /// registration, or close it at exit.
    pub(crate) fn journal_mut(&mut self) -> &mut crate::persistence::CoreJournal {
        &mut self.services.journal
    }

    /// Hands the host the core's journal (the driver opens it before the
    /// first message), replacing the empty one.
    pub(crate) fn set_journal(&mut self, journal: crate::persistence::CoreJournal) {
        self.services.journal = journal;
    }

    /// Why the last read of remembered entities failed (while a shard waits
    /// for its retry).
    pub(crate) fn remember_error(&self) -> Option<&str> {
        self.remember_error.as_deref()
    }

    /// The counters of type `ty` (`None`: not registered here).
    pub(crate) fn figures(&self, ty: TypeIdx) -> Option<TypeFigures> {
        let h = self.types.get(ty.0)?;
        Some(TypeFigures {
            entities: h.live,
            delivered: h.delivered,
            activated: h.activated,
            worker: h.worker.as_ref().map(|w| w.status()),
        })
    }

    /// Whether ask `id` of an entity of this core still waits for its
    /// answer (a late answer need not travel back).
    pub(crate) fn awaits_ask(&self, id: AskId) -> bool {
        self.entity_asks.contains_key(&id)
    }

    /// Whether a stateless worker type runs here (its pool's timers and
    /// idle collection are checked on every [`EntityHost::handle_timeout`]).
    pub(crate) fn has_workers(&self) -> bool {
        self.types.iter().any(|h| h.worker.is_some())
    }

    /// The next output for the driver, or `None`.
    pub(crate) fn poll_output(&mut self) -> Option<HostOutput> {
        self.out.pop_front()
    }

    /// When [`EntityHost::handle_timeout`] is due next (core clock): the
    /// earliest timeout of an entity's ask, retry of a remembered-entity
    /// read, and stop wait of a stopping incarnation. The worker pools'
    /// timers are checked on every call.
    pub(crate) fn poll_timeout(&self) -> Option<Duration> {
        let asks = self.ask_expiry.peek().map(|Reverse((due, _))| *due);
        let retries = self
            .remember_reads
            .iter()
            .filter(|r| r.ticket.is_none())
            .map(|r| r.retry_at);
        let stops = self.stopping.values().map(|s| s.wait_until);
        asks.into_iter().chain(retries).chain(stops).min()
    }

    /// Keeps a reply's payload buffer that the driver wrote out, for a
    /// later [`crate::EntityContext::reply_buffer`].
    pub(crate) fn recycle_reply(&mut self, buf: Vec<u8>) {
        self.services.recycle_reply(buf);
    }

    /// An empty buffer for a reply (a spare one when there is one).
    pub(crate) fn reply_buffer(&mut self) -> Vec<u8> {
        self.services.reply_buffer()
    }

    /// The lifecycle messages the watch book queued, as envelopes for
    /// [`DataPlane::handle_message`] (`(type, envelope)`); empty when there
    /// are none. The driver routes them, drains both queues, and asks
    /// again, at most [`SYSTEM_ROUNDS`] times per input.
    pub(crate) fn take_system(&mut self) -> Vec<(String, UserEnvelope)> {
        if !self.watches.has_outgoing() {
            return Vec::new();
        }
        let n = self.config.number_of_shards;
        self.watches
            .take_outgoing()
            .into_iter()
            .map(|(to, msg)| {
                let env = Envelope {
                    deadline: None,
                    shard: shard_id_of(to.id.as_str(), n),
                    entity: to.id,
                    sender: ReplyTo::System(Box::new(msg)),
                    payload: bytes::Bytes::new(),
                };
                (to.type_name, env)
            })
            .collect()
    }

    // ----- inputs -----

    /// Type `type_name` was registered with the plane (same order, so its
    /// [`TypeIdx`] matches): `factory` makes its entities (`None`: a proxy,
    /// none are hosted), `worker` makes it a stateless worker type whose
    /// requests run on this core's pool.
    pub(crate) fn handle_register_type(
        &mut self,
        type_name: &str,
        factory: Option<EntityFactory>,
        worker: Option<(&WorkerSettings, Option<Duration>)>,
    ) {
        let worker = match (worker, &factory) {
            (Some((w, idle)), Some(_)) => Some(workers::WorkerHost::new(
                w,
                idle,
                self.config.cores,
                self.config.core,
            )),
            _ => None,
        };
        self.types.push(TypeHost {
            name: Rc::from(type_name),
            factory,
            live: 0,
            delivered: 0,
            activated: 0,
            worker,
        });
    }

    /// Carries out `o` if it is the entities' (see the module doc) and
    /// gives it back otherwise, for the driver.
    pub(crate) fn handle_plane_output(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        o: DataOutput,
    ) -> Option<DataOutput> {
        match o {
            DataOutput::Reply {
                to,
                status,
                payload,
            } => match to {
                ReplyTo::System(_) | ReplyTo::EntityAsk { .. } => {
                    self.reply(to, status, payload);
                    None
                }
                to => Some(DataOutput::Reply {
                    to,
                    status,
                    payload,
                }),
            },
            DataOutput::Deliver { ty, envelope } => {
                self.deliver(now, plane, ty, envelope);
                None
            }
            DataOutput::ToWorker { ty, envelope } => {
                self.worker_route(now, plane, ty, envelope);
                None
            }
            DataOutput::StartEntity { ty, shard, entity } => {
                self.ensure_entity(now, plane, ty, shard, &entity);
                None
            }
            DataOutput::StopEntity {
                ty,
                shard,
                entity,
                stop_message,
                reason,
            } => {
                self.stop_entity(now, plane, ty, shard, entity, stop_message, reason);
                None
            }
            DataOutput::TimerFired {
                ty,
                entity,
                key,
                incarnation,
            } => {
                self.fire_timer(now, plane, ty, &entity, key, incarnation);
                None
            }
            DataOutput::Persist { ty, event } => {
                crate::persistence::remember::record(
                    &mut self.services.journal,
                    plane.type_name(ty),
                    plane.region(ty),
                    &event,
                );
                None
            }
            DataOutput::RecoverRememberedEntities { ty, shard } => {
                self.start_remember_read(now, plane, ty, shard, 0);
                None
            }
            o => Some(o),
        }
    }

    /// The answer to ask `id` of an entity of this core (from the core's
    /// inbox): handed to the asker's [`Entity::on_ask_reply`] once, if the
    /// incarnation that asked still lives (else dropped). An answer after
    /// the ask's timeout is `TimedOut`.
    pub(crate) fn handle_ask_reply(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        id: AskId,
        reply: Result<Vec<u8>, EntityAskError>,
    ) {
        let Some(w) = self.entity_asks.remove(&id) else {
            return;
        };
        let reply = if reply.is_ok() && now > w.due {
            Err(EntityAskError::TimedOut)
        } else {
            reply
        };
        let Some(h) = self.types.get_mut(w.ty.0) else {
            return;
        };
        let name = h.name.clone();
        let Some((shard, live)) = running_incarnation(plane, w.ty, &w.entity, w.incarnation) else {
            return;
        };
        let who = Incarnation {
            ty: w.ty,
            id: w.entity,
            shard,
            inc: live.incarnation,
        };
        let mut ctx = EntityContext::new(&who.id, &mut self.services).with_type(&name, live.epoch);
        let entity = &mut live.entity;
        let res = catch_panic(|| entity.on_ask_reply(&mut ctx, id, reply));
        let (h, res) = Harvest::of_call(&mut ctx, "ask reply handler", res);
        drop(ctx);
        self.settle(now, plane, &who, h, res, None);
    }

    /// The journal's durable LSN advanced to `durable_lsn`: entities with
    /// events in flight run their handlers and answer, stopping ones may
    /// stop, and finished reads of remembered entities start their shards.
    pub(crate) fn handle_durable(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        durable_lsn: u64,
    ) {
        self.poll_remember_reads(now, plane);
        let mut waiting = self.durable.take_waiting();
        for w in waiting.drain(..) {
            let (t, id, inc) = (w.type_name, w.id, w.incarnation);
            if self.stopping.contains_key(&inc) {
                self.stopping_durable(now, plane, inc, durable_lsn);
                continue;
            }
            let Some(ty) = self.type_index(&t) else {
                continue;
            };
            let name = self.types[ty.0].name.clone();
            let Some((shard, live)) = running_incarnation(plane, ty, &id, inc) else {
                continue;
            };
            let mut ctx = EntityContext::new(&id, &mut self.services).with_type(&name, live.epoch);
            let entity = &mut live.entity;
            let res = catch_panic(|| entity.on_durable(&mut ctx, durable_lsn));
            let (h, res) = Harvest::of_call(&mut ctx, "durability handler", res);
            drop(ctx);
            let who = Incarnation { ty, shard, id, inc };
            self.settle(now, plane, &who, h, res, None);
        }
        self.durable.give_back(waiting);
    }

    /// Member `m` was removed: watchers here whose target's home (as this
    /// core's regions know it) was on `m` get `Terminated(NodeRemoved)`.
    /// Call it before the plane forgets the homes on `m`.
    pub(crate) fn handle_member_removed(&mut self, plane: &DataPlane, m: &UniqueAddress) {
        let n = self.config.number_of_shards;
        self.watches.on_member_removed(|k| {
            plane.type_index(&k.type_name).is_some_and(|ty| {
                plane
                    .region(ty)
                    .home_of(shard_id_of(k.id.as_str(), n))
                    .is_some_and(|(r, _)| r.member == *m)
            })
        });
    }

    /// The node stopped (after [`DataPlane::handle_stop`]): every entity
    /// stops (those waiting for appends in flight or a recovery read once
    /// those have an outcome, or at [`EntityHost::handle_drain_end`]),
    /// reads of remembered entities are
    /// dropped, the worker pools stop and their queued requests are
    /// answered `ShuttingDown`.
    pub(crate) fn handle_node_stop(&mut self, now: Duration, plane: &mut DataPlane) {
        for i in 0..self.types.len() {
            let mut live: Vec<(ShardId, EntityId, Live)> = plane
                .entity_slots_mut(TypeIdx(i))
                .filter_map(|(s, id, slot)| slot.take().map(|l| (s, id.clone(), l)))
                .collect();
            self.types[i].live -= live.len();
            // The region tables' order is a hash order: stop by id instead.
            live.sort_by(|a, b| a.1.cmp(&b.1));
            for (shard, id, l) in live {
                self.begin_stop(
                    now,
                    plane,
                    TypeIdx(i),
                    shard,
                    id,
                    l,
                    TerminatedReason::NodeStopped,
                    false,
                );
            }
        }
        for r in std::mem::take(&mut self.remember_reads) {
            if let Some(ticket) = r.ticket {
                crate::persistence::remember::recover_forget(&mut self.services.journal, ticket);
            }
        }
        self.workers_stop();
        self.drain_completions(now, plane);
    }

    /// The stop drain ended: incarnations still waiting for their appends
    /// stop now.
    pub(crate) fn handle_drain_end(&mut self, now: Duration, plane: &mut DataPlane) {
        let mut incs: Vec<u64> = self.stopping.keys().copied().collect();
        incs.sort_unstable();
        for inc in incs {
            if let Some(st) = self.stopping.remove(&inc) {
                self.end_stop(now, plane, st);
            }
        }
    }

    /// Time passed: entities' asks past their timeout get `TimedOut`, failed
    /// remembered-entity reads due for a retry start again, stopping
    /// incarnations kept past their stop wait stop if they may
    /// ([`Entity::may_stop_waiting`]), and the worker pools fire their due
    /// timers and collect idle activations.
    pub(crate) fn handle_timeout(&mut self, now: Duration, plane: &mut DataPlane) {
        self.workers_tick(now, plane);
        self.stop_waits(now, plane);
        while self
            .ask_expiry
            .peek()
            .is_some_and(|Reverse((due, _))| *due <= now)
        {
            let Some(Reverse((_, id))) = self.ask_expiry.pop() else {
                break;
            };
            self.handle_ask_reply(now, plane, id, Err(EntityAskError::TimedOut));
        }
        if self
            .remember_reads
            .iter()
            .any(|r| r.ticket.is_none() && r.retry_at <= now)
        {
            self.poll_remember_reads(now, plane);
        }
    }

    // ----- running entities -----

    fn type_index(&self, t: &str) -> Option<TypeIdx> {
        self.types.iter().position(|h| &*h.name == t).map(TypeIdx)
    }

    fn next_reply_token(&mut self) -> ReplyToken {
        let t = ReplyToken(self.next_token);
        self.next_token += 1;
        t
    }

    /// Answers `to`: a system message that could not be delivered goes to
    /// the watch book, an answer to an ask nobody waits for any more is
    /// dropped, anything else goes out.
    fn reply(&mut self, to: ReplyTo, status: Status, payload: Vec<u8>) {
        match to {
            ReplyTo::Nobody => {}
            ReplyTo::System(m) => {
                if status != Status::Ok {
                    tracing::debug!(?status, "system message undeliverable");
                    self.watches.undeliverable(*m);
                }
            }
            ReplyTo::EntityAsk { id } if !self.entity_asks.contains_key(&AskId(id)) => {}
            to => self.out.push_back(HostOutput::Reply {
                to,
                status,
                payload,
            }),
        }
    }

    /// Starts entity `id` of `ty` in `shard` unless it runs.
    fn ensure_entity(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        shard: ShardId,
        id: &EntityId,
    ) -> Ensured {
        let Some(h) = self.types.get_mut(ty.0) else {
            return Ensured::NotHosted;
        };
        let Some(f) = h.factory.as_ref() else {
            return Ensured::NotHosted;
        };
        match plane.entity_slot_mut(ty, shard, id) {
            Some(Some(_)) => return Ensured::Running,
            Some(None) => {}
            // Its incarnation stopped while this message waited in the
            // plane's queue: it starts again, as if routed now, when its
            // shard runs here.
            None => {
                if !plane.activate_for_host(now, ty, shard, id) {
                    return Ensured::NotLive;
                }
            }
        }
        let mut epoch = 0;
        let mut hosted_max = 0;
        for (s, g, _) in plane.region(ty).hosted_shards() {
            hosted_max = hosted_max.max(g.0);
            if s == shard {
                epoch = g.0;
            }
        }
        if let Ok(log) = self.services.journal.log() {
            log.set_hosted_generation(hosted_max);
        }
        let inc = self.next_incarnation;
        self.next_incarnation += 1;
        let name = h.name.clone();
        let mut ctx = EntityContext::new(id, &mut self.services).with_type(&name, epoch);
        // The factory and `on_start` are the user's code: a panic fails the
        // incarnation at once, as an error of its handler would.
        let mut made: Option<Box<dyn Entity>> = None;
        let started = catch_panic(|| made.insert(f(id)).on_start(&mut ctx));
        let (harvest, res) = Harvest::of_call(&mut ctx, "start", started.map(Ok));
        drop(ctx);
        let entity = match (&res, made) {
            (Ok(()), Some(e)) => e,
            (_, made) => {
                if let Some(e) = made {
                    drop_entity(e, &name, Some(id));
                }
                Box::new(StartFailed("start panicked".to_string()))
            }
        };
        let failed = res.as_ref().err().map(ToString::to_string);
        h.activated += 1;
        h.live += 1;
        if let Some(slot) = plane.entity_slot_mut(ty, shard, id) {
            *slot = Some(Live {
                entity: std::mem::ManuallyDrop::new(entity),
                incarnation: inc,
                epoch,
            });
        }
        let who = Incarnation {
            ty,
            id: id.clone(),
            shard,
            inc,
        };
        self.settle(now, plane, &who, harvest, res, None);
        match failed {
            Some(why) => Ensured::Failed(why),
            None => Ensured::Running,
        }
    }

    /// Runs a message on its entity (started first if need be); a system
    /// message goes to the watch book.
    fn deliver(&mut self, now: Duration, plane: &mut DataPlane, ty: TypeIdx, env: UserEnvelope) {
        if let ReplyTo::System(m) = env.sender {
            return self.deliver_system(now, plane, ty, env.shard, env.entity, *m);
        }
        match self.ensure_entity(now, plane, ty, env.shard, &env.entity) {
            Ensured::Running => {}
            Ensured::NotHosted => {
                return self.reply(
                    env.sender,
                    Status::UnknownEntityType,
                    b"type not hosted here".to_vec(),
                );
            }
            // The shard is no longer running here: the region routes the
            // message again (buffered for, or forwarded to, its home). It
            // goes behind what the region buffered meanwhile: when an
            // entity fails while a hand-off drains its older messages, a
            // newer message buffered for the new home can overtake the
            // ones drained after the failure (the entity's only
            // incarnation is still the new home's; ordering across a
            // failure during a hand-off is not kept).
            Ensured::NotLive => {
                let name = self.types[ty.0].name.clone();
                return plane.handle_message(now, &name, env);
            }
            Ensured::Failed(why) => {
                return self.reply(env.sender, Status::EntityFailed, why.into_bytes());
            }
        }
        let token = self.next_reply_token();
        let Some(h) = self.types.get_mut(ty.0) else {
            return;
        };
        let name = h.name.clone();
        let Some(Some(live)) = plane.entity_slot_mut(ty, env.shard, &env.entity) else {
            return;
        };
        h.delivered += 1;
        let mut ctx = EntityContext::new(&env.entity, &mut self.services)
            .with_type(&name, live.epoch)
            .with_reply_token(token.0);
        let entity = &mut live.entity;
        let res = catch_panic(|| entity.handle(&mut ctx, &env.payload));
        let payload = ctx.take_reply().unwrap_or_default();
        let deferred = ctx.reply_deferred();
        let (harvest, res) = Harvest::of_call(&mut ctx, "handler", res);
        drop(ctx);
        let who = Incarnation {
            ty,
            shard: env.shard,
            inc: live.incarnation,
            id: env.entity,
        };
        let reply = HandlerReply {
            sender: env.sender,
            deadline: env.deadline,
            token,
            payload,
            deferred,
        };
        self.settle(now, plane, &who, harvest, res, Some(reply));
    }

    /// Applies what a handler of `who` asked, the one place it is done: its
    /// watch commands, the messages it sent (a forward takes the handled
    /// message's sender), then, if it failed, the sender is answered
    /// `EntityFailed` and the incarnation stops; else its reply goes out (or
    /// waits in the plane's durability barrier), its timers are armed, it
    /// waits for durability if it asked, deferred replies completed
    /// meanwhile go out, and its passivation is asked of the region.
    fn settle(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        who: &Incarnation,
        h: Harvest,
        res: Result<(), EntityError>,
        reply: Option<HandlerReply>,
    ) {
        let name = self.types[who.ty.0].name.clone();
        if h.failed || !h.watches.is_empty() {
            let key = EntityKey {
                type_name: name.to_string(),
                id: who.id.clone(),
            };
            if h.failed {
                self.watches.mark_failed(&key);
            }
            self.watches.commands(&key, h.watches);
        }
        let (mut sender, deadline, answer) = match reply {
            Some(r) => (
                Some(r.sender),
                r.deadline,
                Some((r.token, r.payload, r.deferred)),
            ),
            None => (None, None, None),
        };
        if !h.outgoing.is_empty() {
            self.send_outgoing(now, h.outgoing, &mut sender, deadline, Some(who));
        }
        if let Err(e) = res {
            if answer.is_some() {
                if let Some(s) = sender {
                    self.reply(s, Status::EntityFailed, e.to_string().into_bytes());
                }
            } else if !h.panicked {
                // A told message (nobody to answer) from any sender can
                // cause one per message: one line per window.
                crate::runtime::limited!(warn, entity = %who.id, error = %e, "entity failed; it stops");
            }
            self.fail_entity(now, plane, who);
            return;
        }
        if let Some((token, payload, deferred)) = answer {
            let s = sender.unwrap_or(ReplyTo::Nobody);
            if deferred {
                plane.handle_reply_deferred(token.0, who.inc, s);
            } else {
                self.reply(s, Status::Ok, payload);
            }
        }
        if !h.timers.is_empty() {
            plane.handle_entity_timers(now, who.ty, &who.id, who.inc, h.timers);
        }
        if h.durable {
            self.durable
                .wait(&mut self.services.journal, &name, &who.id, who.inc);
        }
        self.drain_completions(now, plane);
        if h.passivate {
            plane.handle_passivate(now, who.ty, who.shard, &who.id);
        }
    }

    /// A handler of `who` failed: the incarnation stops at once (its watchers
    /// told, its deferred replies answered) and its region learns it.
    fn fail_entity(&mut self, now: Duration, plane: &mut DataPlane, who: &Incarnation) {
        let taken = match plane.entity_slot_mut(who.ty, who.shard, &who.id) {
            Some(slot) if slot.as_ref().is_some_and(|l| l.incarnation == who.inc) => slot.take(),
            _ => None,
        };
        if let Some(mut l) = taken {
            self.types[who.ty.0].live -= 1;
            self.call_on_stop(who.ty, &who.id, &mut l);
            self.entity_gone(who.ty, &who.id, TerminatedReason::Failed);
        }
        self.fail_deferred(now, plane, who.inc);
        plane.handle_entity_stopped(now, who.ty, who.shard, &who.id);
    }

    /// A system message reached its entity's home region (delivered, or
    /// handed back because the entity is not active).
    fn deliver_system(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        shard: ShardId,
        entity: EntityId,
        msg: SystemMsg,
    ) {
        let Some(h) = self.types.get(ty.0) else {
            return;
        };
        let active = plane.entity_running(ty, shard, &entity);
        let me = EntityKey {
            type_name: h.name.to_string(),
            id: entity,
        };
        match msg {
            SystemMsg::Watch { watcher, .. } => self.watches.on_watch(me, watcher, active),
            SystemMsg::Unwatch { watcher } => self.watches.on_unwatch(&me, &watcher),
            SystemMsg::Terminated { of, reason } => {
                if !active || !self.watches.take_watch(&me, &of) {
                    return;
                }
                let name = self.types[ty.0].name.clone();
                let Some(Some(live)) = plane.entity_slot_mut(ty, shard, &me.id) else {
                    return;
                };
                let mut ctx =
                    EntityContext::new(&me.id, &mut self.services).with_type(&name, live.epoch);
                let entity = &mut live.entity;
                let res = catch_panic(|| {
                    entity.on_terminated(&mut ctx, &of.type_name, &of.id, reason);
                    Ok(())
                });
                let (harvest, res) = Harvest::of_call(&mut ctx, "terminated handler", res);
                drop(ctx);
                let who = Incarnation {
                    ty,
                    shard,
                    inc: live.incarnation,
                    id: me.id,
                };
                self.settle(now, plane, &who, harvest, res, None);
            }
        }
    }

    /// Runs an entity's timer `key` if incarnation `inc` still lives.
    fn fire_timer(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        id: &EntityId,
        key: u64,
        inc: u64,
    ) {
        let Some(h) = self.types.get_mut(ty.0) else {
            return;
        };
        let name = h.name.clone();
        let Some((shard, live)) = running_incarnation(plane, ty, id, inc) else {
            return;
        };
        let mut ctx = EntityContext::new(id, &mut self.services).with_type(&name, live.epoch);
        let entity = &mut live.entity;
        let res = catch_panic(|| {
            entity.on_timer(&mut ctx, key);
            Ok(())
        });
        let (harvest, res) = Harvest::of_call(&mut ctx, "timer", res);
        drop(ctx);
        let who = Incarnation {
            ty,
            id: id.clone(),
            shard,
            inc,
        };
        self.settle(now, plane, &who, harvest, res, None);
    }

    /// The incarnation of `id` stopped: tells its watchers, drops its watches.
    fn entity_gone(&mut self, ty: TypeIdx, id: &EntityId, reason: TerminatedReason) {
        let key = EntityKey {
            type_name: self.types[ty.0].name.to_string(),
            id: id.clone(),
        };
        self.watches.on_stopped(&key, reason);
    }

    /// Sends the deferred replies entities answered (and frees the worker
    /// activations that waited on them).
    fn drain_completions(&mut self, now: Duration, plane: &mut DataPlane) {
        let mut done = self.services.take_completions();
        for c in done.drain(..) {
            plane.handle_reply_durable(c.token, c.status, c.payload);
            self.release_replies(plane);
            self.worker_completed(now, plane, ReplyToken(c.token));
        }
        // The emptied buffer is kept for the next calls (no allocation per
        // deferred reply); completions pushed meanwhile stay queued.
        if self.services.completions.is_empty() {
            self.services.completions = done;
        }
    }

    /// Sends the replies the plane's durability barrier released.
    fn release_replies(&mut self, plane: &mut DataPlane) {
        while let Some(r) = plane.poll_reply() {
            self.reply(r.to, r.status, r.payload);
        }
    }

    /// An incarnation stopped: answers its deferred replies (those it
    /// answered itself first), the rest with `EntityFailed`.
    fn fail_deferred(&mut self, now: Duration, plane: &mut DataPlane, inc: u64) {
        self.drain_completions(now, plane);
        plane.handle_incarnation_stopped(inc);
        self.release_replies(plane);
    }

    // ----- stopping entities -----

    /// The region stops entity `entity` (passivation, hand-off): its stop
    /// message first, then the stop.
    #[allow(clippy::too_many_arguments)]
    fn stop_entity(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        shard: ShardId,
        entity: EntityId,
        stop_message: Option<bytes::Bytes>,
        reason: StopReason,
    ) {
        // A stop the region asked of an incarnation that is gone: it failed
        // while this output waited, and a message queued behind the failure
        // started another one, which the region counts as active. That one
        // is not stopped (the region would lose track of it).
        if !plane.entity_stopping(ty, shard, &entity) {
            tracing::debug!(entity = %entity, ?reason, "stale stop ignored");
            return;
        }
        if let Some(m) = stop_message {
            let env = Envelope {
                deadline: None,
                entity: entity.clone(),
                shard,
                sender: ReplyTo::Nobody,
                payload: m,
            };
            self.deliver(now, plane, ty, env);
        }
        tracing::debug!(entity = %entity, ?reason, "stopping entity");
        let live = plane
            .entity_slot_mut(ty, shard, &entity)
            .and_then(|slot| slot.take());
        match live {
            Some(l) => {
                self.types[ty.0].live -= 1;
                let why = match reason {
                    StopReason::HandOff => TerminatedReason::HandOff,
                    _ => TerminatedReason::Stopped,
                };
                // The region learns that it stopped (and a hand-off's
                // `ShardStopped` can go) only once its appends in flight
                // have an outcome.
                self.begin_stop(now, plane, ty, shard, entity, l, why, true);
            }
            // No incarnation runs: the region is told it stopped, unless
            // one of the entity is already stopping (an earlier, stale stop
            // took it while it waits for its appends): that one tells the
            // region when it has stopped, and the entity must not start
            // again before.
            None => {
                let stopping = self
                    .stopping
                    .values()
                    .any(|st| st.tell_region && st.ty == ty && st.id == entity);
                if !stopping {
                    plane.handle_entity_stopped(now, ty, shard, &entity);
                }
            }
        }
    }

    /// Stops incarnation `l` of `id`: at once, or (when it has journal
    /// appends without an outcome, or a recovery read in flight with
    /// commands stashed, [`Entity::on_stopping`]) once they have one: it is
    /// kept aside, gets [`Entity::on_durable`] as the journal's durable LSN
    /// moves or the read finishes, and stops then (or after its stop wait,
    /// if [`Entity::may_stop_waiting`]). Only then are its watchers told
    /// and, with `tell_region`, the region (so a hand-off's `ShardStopped`
    /// leaves after every stopped entity's events are durable).
    #[allow(clippy::too_many_arguments)]
    fn begin_stop(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        shard: ShardId,
        id: EntityId,
        mut l: Live,
        reason: TerminatedReason,
        tell_region: bool,
    ) {
        let entity = &mut l.entity;
        let (keep, reason) = match catch_panic(|| entity.on_stopping()) {
            Ok(keep) => (keep, reason),
            Err(why) => {
                let name = self.types[ty.0].name.clone();
                entity_panicked(&name, Some(&id), "on_stopping", &why);
                (false, TerminatedReason::Failed)
            }
        };
        self.drain_completions(now, plane);
        let st = Stopping {
            ty,
            shard,
            id,
            live: l,
            reason,
            tell_region,
            wait_until: now + crate::entity::STOP_WAIT,
        };
        if keep {
            let inc = st.live.incarnation;
            let name = self.types[ty.0].name.clone();
            self.durable
                .wait_stopping(&mut self.services.journal, &name, &st.id, inc);
            self.stopping.insert(inc, st);
        } else {
            self.end_stop(now, plane, st);
        }
    }

    /// Stopping incarnations past their stop wait: those that may stop
    /// without waiting longer stop now; the others are asked again one
    /// [`crate::entity::STOP_WAIT`] later.
    fn stop_waits(&mut self, now: Duration, plane: &mut DataPlane) {
        let mut due: Vec<u64> = self
            .stopping
            .iter()
            .filter(|(_, s)| s.wait_until <= now)
            .map(|(inc, _)| *inc)
            .collect();
        due.sort_unstable();
        for inc in due {
            let Some(st) = self.stopping.get_mut(&inc) else {
                continue;
            };
            let entity = &mut st.live.entity;
            match catch_panic(|| entity.may_stop_waiting()) {
                Ok(false) => {
                    st.wait_until = now + crate::entity::STOP_WAIT;
                    continue;
                }
                Ok(true) => {}
                Err(why) => {
                    let name = &self.types[st.ty.0].name;
                    entity_panicked(name, Some(&st.id), "may_stop_waiting", &why);
                    st.reason = TerminatedReason::Failed;
                }
            }
            if let Some(st) = self.stopping.remove(&inc) {
                tracing::debug!(entity = %st.id, "stopping entity stops after its stop wait");
                self.end_stop(now, plane, st);
            }
        }
    }

    /// Runs `on_stop` of incarnation `live` of `id` (deferred replies it
    /// answers there go out with the next completions).
    fn call_on_stop(&mut self, ty: TypeIdx, id: &EntityId, live: &mut Live) {
        let name = self.types[ty.0].name.clone();
        let mut ctx = EntityContext::new(id, &mut self.services).with_type(&name, live.epoch);
        let entity = &mut live.entity;
        // The incarnation stops anyway: a panic is logged, nothing more.
        if let Err(why) = catch_panic(|| entity.on_stop(&mut ctx)) {
            entity_panicked(&name, Some(id), "on_stop", &why);
        }
    }

    /// The last step of a stop: `on_stop`, the incarnation's deferred
    /// replies, its watchers, and (with `tell_region`) the region.
    fn end_stop(&mut self, now: Duration, plane: &mut DataPlane, mut st: Stopping) {
        self.call_on_stop(st.ty, &st.id, &mut st.live);
        let inc = st.live.incarnation;
        self.fail_deferred(now, plane, inc);
        self.entity_gone(st.ty, &st.id, st.reason);
        if st.tell_region {
            plane.handle_entity_stopped(now, st.ty, st.shard, &st.id);
        }
    }

    /// The durable LSN moved while incarnation `inc` is stopping: its
    /// handlers run and answer (what else they ask is dropped: it is
    /// stopping); it stops once nothing is in flight.
    fn stopping_durable(&mut self, now: Duration, plane: &mut DataPlane, inc: u64, durable: u64) {
        let Some(st) = self.stopping.get_mut(&inc) else {
            return;
        };
        let name = self.types[st.ty.0].name.clone();
        let mut ctx =
            EntityContext::new(&st.id, &mut self.services).with_type(&name, st.live.epoch);
        let entity = &mut st.live.entity;
        let res = catch_panic(|| entity.on_durable(&mut ctx, durable));
        let (_, mut res) = Harvest::of_call(&mut ctx, "durability handler", res);
        drop(ctx);
        let keep = res.is_ok()
            && match catch_panic(|| st.live.entity.on_stopping()) {
                Ok(keep) => keep,
                Err(why) => {
                    entity_panicked(&name, Some(&st.id), "on_stopping", &why);
                    res = Err(EntityError::Failed(format!("on_stopping panicked: {why}")));
                    false
                }
            };
        let id = st.id.clone();
        self.drain_completions(now, plane);
        if keep {
            self.durable
                .wait_stopping(&mut self.services.journal, &name, &id, inc);
            return;
        }
        let Some(mut st) = self.stopping.remove(&inc) else {
            return;
        };
        if let Err(e) = res {
            tracing::warn!(entity = %st.id, error = %e, "entity failed on a durable event while stopping");
            st.reason = TerminatedReason::Failed;
        }
        self.end_stop(now, plane, st);
    }

    // ----- remembered entities -----

    /// Starts reading the remembered entities of `shard` (waiting in
    /// `Recovering`): the local journal answers at once, the database on a
    /// reader thread (the durability wake then polls it). A failed read
    /// starts nothing: the shard keeps waiting, its messages buffered in
    /// the region (bounded by `buffer_size` and their deadlines), and the
    /// read is retried after a backoff; the reason is in
    /// [`EntityHost::remember_error`] meanwhile.
    fn start_remember_read(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        shard: ShardId,
        failures: u32,
    ) {
        use crate::persistence::remember::{self, RememberRead};
        let Some(generation) = plane.region(ty).recovering_generation(shard) else {
            return;
        };
        match remember::recover_start(
            &mut self.services.journal,
            plane.type_name(ty),
            plane.region(ty),
            shard,
        ) {
            RememberRead::Ready(Ok(ids)) => {
                plane.handle_remembered_entities(now, ty, shard, ids);
                self.remember_read_ok();
            }
            RememberRead::Ready(Err(e)) => {
                self.remember_failed(now, plane, ty, shard, generation.0, failures, &e);
            }
            RememberRead::Pending(ticket) => self.remember_reads.push(RememberPending {
                ty,
                shard,
                generation: generation.0,
                ticket: Some(ticket),
                retry_at: now,
                failures,
            }),
        }
    }

    fn remember_read_ok(&mut self) {
        if !self.remember_reads.iter().any(|r| r.failures > 0) {
            self.remember_error = None;
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn remember_failed(
        &mut self,
        now: Duration,
        plane: &DataPlane,
        ty: TypeIdx,
        shard: ShardId,
        generation: u64,
        failures: u32,
        e: &crate::persistence::LogError,
    ) {
        let delay = REMEMBER_RETRY_MIN
            .saturating_mul(1 << failures.min(5))
            .min(REMEMBER_RETRY_MAX);
        let t = plane.type_name(ty);
        let why = format!(
            "journal read of remembered entities failed: shard {} of {t}: {e}; the shard \
             waits and the read is retried",
            shard.0
        );
        if failures == 0 {
            tracing::warn!(core = self.config.core, type_name = t, shard = shard.0, error = %e,
                "remembered entities not read; the shard does not start until they are (retrying)");
        } else {
            tracing::debug!(core = self.config.core, type_name = t, shard = shard.0, error = %e, "remembered entities not read again");
        }
        self.remember_error = Some(why);
        self.remember_reads.push(RememberPending {
            ty,
            shard,
            generation,
            ticket: None,
            retry_at: now + delay,
            failures: failures.saturating_add(1),
        });
    }

    /// Takes the finished reads of remembered entities (their shards start)
    /// and starts the retries that are due; drops reads of shards that are
    /// no longer waiting for them with that generation.
    fn poll_remember_reads(&mut self, now: Duration, plane: &mut DataPlane) {
        use crate::persistence::remember;
        if self.remember_reads.is_empty() {
            return;
        }
        for r in std::mem::take(&mut self.remember_reads) {
            let current = plane
                .region(r.ty)
                .recovering_generation(r.shard)
                .is_some_and(|g| g.0 == r.generation);
            match r.ticket {
                Some(ticket) if !current => {
                    remember::recover_forget(&mut self.services.journal, ticket)
                }
                Some(ticket) => {
                    match remember::recover_poll(
                        &mut self.services.journal,
                        plane.type_name(r.ty),
                        r.shard,
                        ticket,
                    ) {
                        None => self.remember_reads.push(r),
                        Some(Ok(ids)) => {
                            plane.handle_remembered_entities(now, r.ty, r.shard, ids);
                            if r.failures > 0 {
                                tracing::info!(
                                    core = self.config.core,
                                    type_name = plane.type_name(r.ty),
                                    shard = r.shard.0,
                                    "remembered entities read after a retry; the shard starts"
                                );
                            }
                        }
                        Some(Err(e)) => {
                            self.remember_failed(
                                now,
                                plane,
                                r.ty,
                                r.shard,
                                r.generation,
                                r.failures,
                                &e,
                            );
                        }
                    }
                }
                None if !current => {}
                None if r.retry_at <= now => {
                    self.start_remember_read(now, plane, r.ty, r.shard, r.failures);
                }
                None => self.remember_reads.push(r),
            }
        }
        self.remember_read_ok();
    }

    // ----- messages between entities -----

    /// Hands the messages a handler sent to the driver, for this core's own
    /// inbox (so a handler never runs inside another's). A forward takes
    /// `sender` and `handled_deadline`, the ask deadline of the message
    /// being handled: the original sender stops waiting then, so a forward
    /// still buffered at that time is answered `Unavailable` and never
    /// delivered later. An ask waits for its answer
    /// ([`EntityHost::handle_ask_reply`]) until its timeout; only the
    /// incarnation `asker` whose handler sent them can ask (`None`: a
    /// stateless worker's, whose asks are dropped).
    fn send_outgoing(
        &mut self,
        now: Duration,
        out: Vec<Outgoing>,
        sender: &mut Option<ReplyTo>,
        handled_deadline: Option<Duration>,
        asker: Option<&Incarnation>,
    ) {
        for o in out {
            let mut deadline = None;
            let to = if let Some(a) = &o.ask {
                // An ask between entities: its answer comes back to the
                // asking incarnation.
                let asker = asker
                    .filter(|w| {
                        w.id == a.from_id && *self.types[w.ty.0].name == *a.from_type.as_str()
                    })
                    .map(|w| (w.ty, w.inc));
                let Some((ty, incarnation)) = asker else {
                    tracing::warn!(
                        entity = %a.from_id,
                        "ask dropped: only sharded entities can ask"
                    );
                    continue;
                };
                let due = now.saturating_add(a.timeout);
                self.entity_asks.insert(
                    a.id,
                    EntityAskWait {
                        ty,
                        entity: a.from_id.clone(),
                        incarnation,
                        due,
                    },
                );
                self.ask_expiry.push(Reverse((due, a.id)));
                deadline = Some(now + a.timeout.min(self.config.ask_timeout));
                ReplyTo::EntityAsk { id: a.id.0 }
            } else if o.forward {
                deadline = handled_deadline;
                sender.take().unwrap_or(ReplyTo::Nobody)
            } else {
                ReplyTo::Nobody
            };
            if o.payload.len() as u64 > self.config.max_message_size_bytes {
                // Refused here, as the fronts, the embedding API and a
                // data lane to another node refuse it: the same answer
                // whether the target is on this node or not.
                let msg = format!(
                    "message of {} bytes exceeds requests.max_message_size_bytes ({})",
                    o.payload.len(),
                    self.config.max_message_size_bytes
                );
                if matches!(to, ReplyTo::Nobody) {
                    crate::runtime::limited!(
                        warn,
                        type_name = %o.type_name,
                        entity = %o.entity_id,
                        bytes = o.payload.len(),
                        "message between entities dropped: over requests.max_message_size_bytes"
                    );
                }
                self.reply(to, Status::TooLarge, msg.into_bytes());
                continue;
            }
            let envelope = Envelope {
                deadline,
                shard: shard_id_of(o.entity_id.as_str(), self.config.number_of_shards),
                entity: o.entity_id,
                sender: to,
                payload: o.payload.into(),
            };
            self.out.push_back(HostOutput::Send {
                type_name: o.type_name,
                envelope,
            });
        }
    }
}

#[cfg(test)]
mod tests;
