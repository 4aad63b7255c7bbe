//! The entity API: user actors hosted by the regions.
//!
//! An [`Entity`] lives on exactly one data core (the home of its shard). Its
//! handler runs on that core's executor, one message at a time, to
//! completion (it must not block). It answers through the
//! [`EntityContext`]: [`EntityContext::reply`], [`EntityContext::passivate`]
//! (ask to be stopped), timers, its own id, and lifecycle watches
//! ([`EntityContext::watch`], [`Entity::on_terminated`]).
//!
//! Entities send messages to other entities with [`EntityContext::tell`]
//! and [`EntityContext::forward`] (through the normal routing path).
//!
//! Built in: [`Echo`] (a stateless worker), [`Counter`] (durable) and
//! [`Aggregate`] (a pre-aggregating stateless worker); payloads in
//! `docs/interfaces.md`.

pub mod aggregate;
pub mod persistent;
pub mod supervision;
pub mod worker;

pub use aggregate::Aggregate;

use std::sync::Arc;
use std::time::Duration;

use shardline_core::ids::EntityId;
use thiserror::Error;

/// A failure of an entity's handler: the message is answered with
/// `Status::EntityFailed` and the incarnation is stopped.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EntityError {
    /// The handler failed for the given reason.
    #[error("entity failed: {0}")]
    Failed(String),
}

/// Runs `f`, a call of an entity's code, catching a panic: `Err` with the
/// panic's message (its `&str` or `String` payload, else `"panic"`) when
/// it panicked. The payload is dropped under its own `catch_unwind`, and
/// forgotten if dropping it panics again, so a panic never leaves the
/// call. With `panic = "abort"` nothing is caught: the process aborts.
pub(crate) fn catch_panic<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => Ok(r),
        Err(payload) => {
            let text = panic_text(payload.as_ref());
            drop_panic_payload(payload);
            Err(text)
        }
    }
}

/// The message of a panic payload: its `&str` or `String`, else `"panic"`.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_string()
    }
}

/// Drops a panic payload, which is user code too (its `Drop`): a panic
/// there is caught, and that second payload is forgotten (leaked) rather
/// than dropped, which could panic again.
pub(crate) fn drop_panic_payload(payload: Box<dyn std::any::Any + Send>) {
    if let Err(again) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
        drop(payload);
    })) {
        std::mem::forget(again);
    }
}

/// Why a watched entity's incarnation is gone (the reason of a
/// `Terminated` notice, [`Entity::on_terminated`]).
///
/// Semantics follow Akka's DeathWatch
/// (<https://doc.akka.io/docs/akka/current/actors.html#lifecycle-monitoring-aka-deathwatch>):
/// the notice is delivered at most once per watch, also when the watched
/// entity had already stopped (or never ran) when the watch arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TerminatedReason {
    /// Passivated: it asked to stop, was idle for its idle timeout, or was
    /// chosen under the active-entity limit.
    Stopped,
    /// Stopped because it failed: more than `max_restarts` failures within
    /// the window under a supervisor, or a handler error of an
    /// unsupervised entity.
    Failed,
    /// Its shard was handed off (rebalance or its node leaving gracefully).
    HandOff,
    /// Its node stopped serving (downed or stopped) before handing off.
    NodeStopped,
    /// Its node was removed from the cluster (crashed and downed, or left);
    /// sent by the watcher's own node.
    NodeRemoved,
    /// It was not active when the watch arrived (never started or already
    /// stopped); the watch did not create it.
    NotActive,
    /// The watch could not be delivered (unknown type, full buffer, home
    /// node unreachable); the watcher cannot learn of its stop.
    Unreachable,
}

impl TerminatedReason {
    /// The wire code (1 byte).
    pub fn as_u8(self) -> u8 {
        match self {
            TerminatedReason::Stopped => 0,
            TerminatedReason::Failed => 1,
            TerminatedReason::HandOff => 2,
            TerminatedReason::NodeStopped => 3,
            TerminatedReason::NodeRemoved => 4,
            TerminatedReason::NotActive => 5,
            TerminatedReason::Unreachable => 6,
        }
    }

    /// The reason of a wire code; `None` for an unknown code.
    pub fn from_u8(code: u8) -> Option<Self> {
        Some(match code {
            0 => TerminatedReason::Stopped,
            1 => TerminatedReason::Failed,
            2 => TerminatedReason::HandOff,
            3 => TerminatedReason::NodeStopped,
            4 => TerminatedReason::NodeRemoved,
            5 => TerminatedReason::NotActive,
            6 => TerminatedReason::Unreachable,
            _ => return None,
        })
    }
}

/// A watch command of a handler ([`EntityContext::watch`],
/// [`EntityContext::unwatch`]), in the order it asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WatchCommand {
    /// Start watching the entity `id` of type `type_name`.
    Watch {
        /// The watched entity's type.
        type_name: String,
        /// The watched entity's id.
        id: EntityId,
    },
    /// Stop watching it.
    Unwatch {
        /// The watched entity's type.
        type_name: String,
        /// The watched entity's id.
        id: EntityId,
    },
}

/// The ids of the asks between entities of one data core
/// ([`EntityContext::ask`]): core `c`'s ids start at `(c + 1) << 48`, so
/// they are unique in the node without a counter shared by its cores.
#[derive(Debug, Clone)]
pub(crate) struct AskIds {
    next: u64,
}

impl AskIds {
    /// The ask ids of data core `core`.
    pub(crate) fn for_core(core: u16) -> AskIds {
        AskIds {
            next: ((u64::from(core) + 1) << 48) | 1,
        }
    }

    /// The next id.
    fn take(&mut self) -> AskId {
        let id = AskId(self.next);
        self.next += 1;
        id
    }
}

impl Default for AskIds {
    fn default() -> Self {
        AskIds::for_core(0)
    }
}

/// What a data core's entity host lends every call of an entity's code
/// ([`EntityContext`]): the core's journal, the core's ask ids, and the
/// deferred replies answered during calls ([`EntityContext::complete`]),
/// which the host sends after the call returns. Owned by the host; one per
/// core, never shared.
#[derive(Default)]
pub(crate) struct EntityServices {
    /// The core's journal.
    pub journal: crate::persistence::CoreJournal,
    /// The core's ask ids.
    pub asks: AskIds,
    /// Deferred replies answered, not yet sent.
    pub completions: Vec<crate::persistence::Completion>,
    /// Reply buffers the fronts handed back after writing them, lent again
    /// by [`EntityContext::reply_buffer`] (at most [`SPARE_REPLY_BUFFERS`],
    /// each of at most [`SPARE_REPLY_BUFFER_BYTES`] capacity).
    pub spare_replies: Vec<Vec<u8>>,
}

/// Most reply buffers a data core keeps for reuse (count).
pub const SPARE_REPLY_BUFFERS: usize = 256;

/// Largest capacity of a reply buffer kept for reuse, in bytes (a larger
/// one is freed).
pub const SPARE_REPLY_BUFFER_BYTES: usize = 4096;

impl EntityServices {
    /// Services for data core `core` with `journal`.
    pub(crate) fn new(core: u16, journal: crate::persistence::CoreJournal) -> EntityServices {
        EntityServices {
            journal,
            asks: AskIds::for_core(core),
            completions: Vec::new(),
            spare_replies: Vec::new(),
        }
    }

    /// An empty buffer for a reply: a spare one when there is one.
    pub(crate) fn reply_buffer(&mut self) -> Vec<u8> {
        self.spare_replies.pop().unwrap_or_default()
    }

    /// Keeps `buf` (a reply's payload, written out) for a later reply,
    /// within the bounds of [`SPARE_REPLY_BUFFERS`] and
    /// [`SPARE_REPLY_BUFFER_BYTES`].
    pub(crate) fn recycle_reply(&mut self, mut buf: Vec<u8>) {
        if buf.capacity() > 0
            && buf.capacity() <= SPARE_REPLY_BUFFER_BYTES
            && self.spare_replies.len() < SPARE_REPLY_BUFFERS
        {
            buf.clear();
            self.spare_replies.push(buf);
        }
    }

    /// Takes the deferred replies answered since the last call.
    pub(crate) fn take_completions(&mut self) -> Vec<crate::persistence::Completion> {
        std::mem::take(&mut self.completions)
    }
}

/// What a handler may ask of the runtime.
pub struct EntityContext<'a> {
    services: &'a mut EntityServices,
    id: &'a EntityId,
    type_name: &'a str,
    writer_epoch: u64,
    reply_token: Option<u64>,
    reply_deferred: bool,
    await_durable: bool,
    reply: Option<Vec<u8>>,
    passivate: bool,
    timers: Vec<(u64, Option<Duration>)>,
    outgoing: Vec<Outgoing>,
    watches: Vec<WatchCommand>,
    failed_stop: bool,
}

/// A message an entity sends to another entity ([`EntityContext::tell`],
/// [`EntityContext::forward`]); the runtime routes it after the handler
/// returns, through the sending core's inbox and the normal routing path
/// (region, shard home, another node), at most once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Outgoing {
    /// The target's entity type.
    pub type_name: String,
    /// The target's id.
    pub entity_id: EntityId,
    /// The message.
    pub payload: Vec<u8>,
    /// Whether the target answers the sender of the message being handled
    /// (a forward) instead of nobody (a tell).
    pub forward: bool,
    /// `Some` for an ask between entities ([`EntityContext::ask`]): the
    /// target's reply comes back to the asking entity.
    pub ask: Option<OutgoingAsk>,
}

/// The ask part of an [`Outgoing`] made by [`EntityContext::ask`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutgoingAsk {
    /// The ask's id, as given to [`Entity::on_ask_reply`].
    pub id: AskId,
    /// The asking entity's type.
    pub from_type: String,
    /// The asking entity's id.
    pub from_id: EntityId,
    /// How long the asker waits for the reply.
    pub timeout: Duration,
}

/// The id of an ask between entities ([`EntityContext::ask`]), unique in
/// the process; [`Entity::on_ask_reply`] names the ask it answers with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AskId(pub u64);

/// Why an ask between entities got no reply ([`Entity::on_ask_reply`]).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum EntityAskError {
    /// The request failed: the status, and the payload that came with it
    /// (the target's error message for `EntityFailed`, the reason for a
    /// message not delivered).
    #[error("ask failed: {status:?}: {}", String::from_utf8_lossy(payload))]
    Failed {
        /// The status of the answer.
        status: crate::envelope::Status,
        /// The answer's payload.
        payload: Vec<u8>,
    },
    /// No answer within the ask's timeout (the message may have reached
    /// its target; a reply arriving later is dropped).
    #[error("ask timed out")]
    TimedOut,
}

impl<'a> EntityContext<'a> {
    /// A context for entity `id` on the core whose host lends `services`
    /// (made by the runtime for each call).
    pub(crate) fn new(id: &'a EntityId, services: &'a mut EntityServices) -> Self {
        EntityContext {
            services,
            id,
            type_name: "",
            writer_epoch: 0,
            reply_token: None,
            reply_deferred: false,
            await_durable: false,
            reply: None,
            passivate: false,
            timers: Vec::new(),
            outgoing: Vec::new(),
            watches: Vec::new(),
            failed_stop: false,
        }
    }

    /// The same context, naming the entity type and the writer epoch (the
    /// shard's allocation generation) that durable entities append with.
    pub(crate) fn with_type(mut self, type_name: &'a str, writer_epoch: u64) -> Self {
        self.type_name = type_name;
        self.writer_epoch = writer_epoch;
        self
    }

    /// Gives the message being handled a reply token (the runtime does this
    /// for every delivered message; see [`Self::defer_reply`]).
    pub(crate) fn with_reply_token(mut self, token: u64) -> Self {
        self.reply_token = Some(token);
        self
    }

    /// This entity's id.
    pub fn self_id(&self) -> &EntityId {
        self.id
    }

    /// This entity's type name (empty when the runtime did not set it).
    pub fn type_name(&self) -> &str {
        self.type_name
    }

    /// The writer epoch of this incarnation's journal appends: the
    /// allocation generation of its shard (0 when unknown).
    pub fn writer_epoch(&self) -> u64 {
        self.writer_epoch
    }

    /// Takes over the reply of the message being handled: the runtime
    /// sends nothing when the handler returns; the entity answers later
    /// (in this or a later call) with [`Self::complete`] and the returned
    /// token. `None` outside a message (timers, start).
    pub fn defer_reply(&mut self) -> Option<u64> {
        let t = self.reply_token?;
        self.reply_deferred = true;
        Some(t)
    }

    /// Whether the handler deferred its reply.
    pub(crate) fn reply_deferred(&self) -> bool {
        self.reply_deferred
    }

    /// Answers the deferred reply `token` (from [`Self::defer_reply`] of
    /// this or an earlier call on the same core) with `status` and
    /// `payload`; the runtime sends it after this call returns (after the
    /// journal made durable what the reply waited for, if the handler's
    /// reply was held). A token answered twice, or after its incarnation
    /// stopped, is dropped.
    pub fn complete(&mut self, token: u64, status: crate::envelope::Status, payload: Vec<u8>) {
        self.services
            .completions
            .push(crate::persistence::Completion {
                token,
                status,
                payload,
            });
    }

    /// This data core's journal (its [`crate::persistence::EventLog`]):
    /// what durable entities append to and recover from.
    ///
    /// # Errors
    /// `"no journal on this core"` when the core has none (it could not
    /// be opened; durable entities fail then).
    pub fn journal(&mut self) -> Result<&mut dyn crate::persistence::EventLog, String> {
        self.services.journal.log()
    }

    /// Records that this call appended `lsn` to the core's journal, so
    /// that [`Entity::on_durable`] comes once it is durable (with
    /// [`Self::await_durable`]).
    pub fn note_appended(&mut self, lsn: shardline_journal::Lsn) {
        self.services.journal.note_appended(lsn);
    }

    /// Asks for [`Entity::on_durable`] calls while this entity has journal
    /// appends that are not durable yet.
    pub fn await_durable(&mut self) {
        self.await_durable = true;
    }

    /// Whether the handler asked for durability notices.
    pub(crate) fn wants_durable(&self) -> bool {
        self.await_durable
    }

    /// An empty buffer to write a reply into and pass to [`Self::reply`] (or
    /// [`Self::complete`]): one the core reuses once an earlier reply was
    /// written to its connection, so a small reply costs no allocation.
    /// A plain `Vec::new()` when the core has none spare.
    pub fn reply_buffer(&mut self) -> Vec<u8> {
        self.services.reply_buffer()
    }

    /// Returns a buffer from [`Self::reply_buffer`] that was not used.
    pub fn return_reply_buffer(&mut self, buf: Vec<u8>) {
        self.services.recycle_reply(buf);
    }

    /// Sets the reply to the message being handled (an ask gets it; a tell
    /// drops it). A message handled without a reply is answered with an empty
    /// payload. The last call wins.
    pub fn reply(&mut self, payload: impl Into<Vec<u8>>) {
        self.reply = Some(payload.into());
    }

    /// Asks to be stopped after this message (Akka's `Passivate`): messages
    /// that arrive meanwhile are buffered and delivered to a new incarnation.
    pub fn passivate(&mut self) {
        self.passivate = true;
    }

    /// Starts (or restarts) timer `key`: after `delay`, [`Entity::on_timer`]
    /// is called with `key`, unless the entity was stopped first.
    pub fn set_timer(&mut self, key: u64, delay: Duration) {
        self.timers.push((key, Some(delay)));
    }

    /// Cancels timer `key` (no effect if not set).
    pub fn cancel_timer(&mut self, key: u64) {
        self.timers.push((key, None));
    }

    /// Watches entity `entity_id` of type `type_name` (Akka's
    /// `context.watch`): when its current incarnation stops, this entity's
    /// [`Entity::on_terminated`] is called once. If it is not active when
    /// the watch arrives, the notice comes at once (reason
    /// [`TerminatedReason::NotActive`]); a watch never creates the entity
    /// nor keeps it alive. Watching twice is one watch; watching itself is
    /// ignored. The watch ends with the notice, with [`Self::unwatch`], or
    /// when this incarnation stops. Works across cores and nodes.
    pub fn watch(&mut self, type_name: &str, entity_id: &EntityId) {
        self.watches.push(WatchCommand::Watch {
            type_name: type_name.to_string(),
            id: entity_id.clone(),
        });
    }

    /// Ends a watch (Akka's `context.unwatch`): no `Terminated` notice for
    /// it is delivered afterwards, even one already on its way.
    pub fn unwatch(&mut self, type_name: &str, entity_id: &EntityId) {
        self.watches.push(WatchCommand::Unwatch {
            type_name: type_name.to_string(),
            id: entity_id.clone(),
        });
    }

    /// Takes the watch commands of the handler, in order.
    pub(crate) fn take_watches(&mut self) -> Vec<WatchCommand> {
        std::mem::take(&mut self.watches)
    }

    /// Asks to be stopped after this message because of failures: like
    /// [`Self::passivate`], and watchers are told
    /// [`TerminatedReason::Failed`] (the supervisor does this after too many
    /// restarts).
    pub fn stop_after_failure(&mut self) {
        self.passivate = true;
        self.failed_stop = true;
    }

    /// Whether the handler asked [`Self::stop_after_failure`].
    pub(crate) fn wants_failed_stop(&self) -> bool {
        self.failed_stop
    }

    /// Takes the reply set by the handler.
    pub(crate) fn take_reply(&mut self) -> Option<Vec<u8>> {
        self.reply.take()
    }

    /// Whether the handler asked to be passivated.
    pub(crate) fn wants_passivation(&self) -> bool {
        self.passivate
    }

    /// Sends `payload` to entity `entity_id` of type `type_name` without
    /// waiting for an answer (its reply is dropped). Delivered at most
    /// once: a full inbox or buffer, an unknown type or an unreachable home
    /// drops it (logged, counted as a dead letter where the region drops it).
    pub fn tell(&mut self, type_name: &str, entity_id: &EntityId, payload: impl Into<Vec<u8>>) {
        self.outgoing.push(Outgoing {
            type_name: type_name.to_string(),
            entity_id: entity_id.clone(),
            payload: payload.into(),
            forward: false,
            ask: None,
        });
    }

    /// Asks entity `entity_id` of type `type_name` (Akka's
    /// `context.ask`): `payload` is routed like a [`Self::tell`], and the
    /// target's reply comes back to this entity as a call of
    /// [`Entity::on_ask_reply`] with the returned [`AskId`], on this
    /// entity's data core, like any message (never concurrently with a
    /// handler). Exactly one such call per ask, while this incarnation
    /// lives: the reply, [`EntityAskError::Failed`] (the message was not
    /// delivered, or the target failed), or [`EntityAskError::TimedOut`]
    /// after `timeout` (a later reply is dropped). The message's ask
    /// deadline is `timeout`, at most `requests.ask_timeout_ms`. If this
    /// incarnation stops first, the answer is dropped. Works across cores
    /// and nodes; only sharded entities can ask (from a stateless worker
    /// the ask is dropped and logged).
    pub fn ask(
        &mut self,
        type_name: &str,
        entity_id: &EntityId,
        payload: impl Into<Vec<u8>>,
        timeout: Duration,
    ) -> AskId {
        let id = self.services.asks.take();
        self.outgoing.push(Outgoing {
            type_name: type_name.to_string(),
            entity_id: entity_id.clone(),
            payload: payload.into(),
            forward: false,
            ask: Some(OutgoingAsk {
                id,
                from_type: self.type_name.to_string(),
                from_id: self.id.clone(),
                timeout,
            }),
        });
        id
    }

    /// Sends `payload` to entity `entity_id` of type `type_name` on behalf
    /// of the sender of the message being handled (Akka's `forward`): the
    /// target's reply goes to that sender, and this handler's own reply is
    /// not sent. Outside a message (timers, start) it is a [`Self::tell`].
    /// The last forward of a handler carries the sender; earlier ones are
    /// tells. A forward also carries the ask deadline of the message being
    /// handled: if it is still buffered (its shard's home unknown, its
    /// entity recovering) when the original sender stops waiting, it is
    /// answered `Unavailable` (not delivered, safe to retry) and never
    /// delivered later.
    pub fn forward(&mut self, type_name: &str, entity_id: &EntityId, payload: impl Into<Vec<u8>>) {
        for o in &mut self.outgoing {
            o.forward = false;
        }
        self.outgoing.push(Outgoing {
            type_name: type_name.to_string(),
            entity_id: entity_id.clone(),
            payload: payload.into(),
            forward: self.reply_token.is_some(),
            ask: None,
        });
    }

    /// Whether the handler forwarded the message being handled (its sender
    /// is answered by the target).
    pub fn forwarded(&self) -> bool {
        self.outgoing.iter().any(|o| o.forward)
    }

    /// Takes the messages the handler sent ([`Self::tell`], [`Self::forward`]).
    pub(crate) fn take_outgoing(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.outgoing)
    }

    /// Takes the timer commands (`(key, Some(delay))` set, `(key, None)` cancel).
    pub(crate) fn take_timers(&mut self) -> Vec<(u64, Option<Duration>)> {
        std::mem::take(&mut self.timers)
    }
}

/// A user actor. Methods run on the entity's data core, never concurrently.
pub trait Entity: 'static {
    /// Called once when the incarnation starts, before its first message.
    fn on_start(&mut self, _ctx: &mut EntityContext<'_>) {}

    /// Handles one message (raw bytes; an rkyv archive if the sender wrote one).
    ///
    /// # Errors
    /// [`EntityError`]: the sender gets `EntityFailed` and the incarnation is
    /// stopped (the next message starts a fresh one).
    ///
    /// # Panics
    /// A panic here (or in another call of this entity's) is caught by the
    /// data core and treated as an `Err`: the sender gets `EntityFailed`
    /// (`handler panicked: <message>`) at once, the incarnation is stopped
    /// and the core's other entities are not affected; a WARN is logged.
    /// Under a [`supervision::Supervisor`] the supervisor catches it first
    /// and restarts the entity. Nothing is caught if the binary is built
    /// with `panic = "abort"`: the process aborts.
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError>;

    /// Called when timer `key` fires.
    fn on_timer(&mut self, _ctx: &mut EntityContext<'_>, _key: u64) {}

    /// Called (after [`EntityContext::await_durable`]) when the core's
    /// journal's durable LSN advanced to `durable_lsn`; the entity runs the
    /// handlers of its events up to it. Default: nothing.
    ///
    /// # Errors
    /// [`EntityError`]: the incarnation is stopped.
    fn on_durable(
        &mut self,
        _ctx: &mut EntityContext<'_>,
        _durable_lsn: u64,
    ) -> Result<(), EntityError> {
        Ok(())
    }

    /// The runtime is about to stop this incarnation (passivation,
    /// hand-off, node stop). Returning `true` keeps it until what it waits
    /// for has an outcome (the journal appends it has in flight, or a
    /// recovery read with commands stashed behind it): meanwhile it gets no
    /// message (the region buffers them), [`Self::on_durable`] is called as
    /// the core's durable LSN moves or a read finishes, and this is asked
    /// again after each call; [`Self::on_stop`] follows once it returns
    /// `false`, or once it was kept for [`STOP_WAIT`] and
    /// [`Self::may_stop_waiting`] says so. A hand-off reports its shard
    /// stopped only after that. Nothing waits on the core meanwhile. An
    /// incarnation kept with no journal append in flight is asked again on
    /// the core's next durability notice (another entity's), at its stop
    /// wait, and at the end of the node's stop drain; its timers do not
    /// fire while it stops. Default: `false` (stop at once).
    fn on_stopping(&mut self) -> bool {
        false
    }

    /// Asked when the runtime kept this stopping incarnation
    /// ([`Self::on_stopping`]) for [`STOP_WAIT`] (and every [`STOP_WAIT`]
    /// after): whether it may stop now although it still waits. `true`
    /// when what it waits for can be abandoned without breaking a promise
    /// (a recovery read: the commands stashed behind it were never handled
    /// and are answered safe to retry); `false` keeps it (appends in flight,
    /// whose commands must be answered with their outcome; the node's stop
    /// drain ends the wait). Default: `false`.
    fn may_stop_waiting(&mut self) -> bool {
        false
    }

    /// Called once when the incarnation stops (passivation, idle timeout,
    /// hand-off, leave, a handler error of an unsupervised entity). The
    /// context has no reply target; deferred replies can still be answered
    /// ([`EntityContext::complete`]) and the journal reached, but what else
    /// it asks (messages, timers, watches) is dropped.
    fn on_stop(&mut self, _ctx: &mut EntityContext<'_>) {}

    /// The answer to an ask this incarnation made with
    /// [`EntityContext::ask`] (`ask` is the id it returned): the target's
    /// reply payload, or why there is none. The context has no reply
    /// target (a reply is dropped); timers, tells, asks, watches and
    /// passivation work as in a handler. Default: nothing.
    ///
    /// # Errors
    /// [`EntityError`]: the incarnation is stopped, as for a handler.
    fn on_ask_reply(
        &mut self,
        _ctx: &mut EntityContext<'_>,
        _ask: AskId,
        _reply: Result<Vec<u8>, EntityAskError>,
    ) -> Result<(), EntityError> {
        Ok(())
    }

    /// Called when an entity this one watches ([`EntityContext::watch`])
    /// stopped, once per watch: `type_name`/`entity_id` name it, `reason`
    /// says why. The context has no reply target (a reply is dropped);
    /// timers, watches and passivation work as in a handler. Default:
    /// nothing.
    fn on_terminated(
        &mut self,
        _ctx: &mut EntityContext<'_>,
        _type_name: &str,
        _entity_id: &EntityId,
        _reason: TerminatedReason,
    ) {
    }
}

/// A boxed entity is an entity: every call goes to the box's content (so
/// a [`supervision::Supervisor`] can hold any child, boxed, or a known
/// one inline).
impl Entity for Box<dyn Entity> {
    fn on_start(&mut self, ctx: &mut EntityContext<'_>) {
        (**self).on_start(ctx)
    }
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        (**self).handle(ctx, message)
    }
    fn on_timer(&mut self, ctx: &mut EntityContext<'_>, key: u64) {
        (**self).on_timer(ctx, key)
    }
    fn on_durable(
        &mut self,
        ctx: &mut EntityContext<'_>,
        durable_lsn: u64,
    ) -> Result<(), EntityError> {
        (**self).on_durable(ctx, durable_lsn)
    }
    fn on_stopping(&mut self) -> bool {
        (**self).on_stopping()
    }
    fn may_stop_waiting(&mut self) -> bool {
        (**self).may_stop_waiting()
    }
    fn on_stop(&mut self, ctx: &mut EntityContext<'_>) {
        (**self).on_stop(ctx)
    }
    fn on_ask_reply(
        &mut self,
        ctx: &mut EntityContext<'_>,
        ask: AskId,
        reply: Result<Vec<u8>, EntityAskError>,
    ) -> Result<(), EntityError> {
        (**self).on_ask_reply(ctx, ask, reply)
    }
    fn on_terminated(
        &mut self,
        ctx: &mut EntityContext<'_>,
        type_name: &str,
        entity_id: &EntityId,
        reason: TerminatedReason,
    ) {
        (**self).on_terminated(ctx, type_name, entity_id, reason)
    }
}

/// How long a stopping incarnation is kept before
/// [`Entity::may_stop_waiting`] is asked (5 s: a few database reads,
/// well within a hand-off's timeout).
pub const STOP_WAIT: Duration = Duration::from_secs(5);

/// Creates an entity for an id; shared by every data core of a node.
pub type EntityFactory = Arc<dyn Fn(&EntityId) -> Box<dyn Entity> + Send + Sync>;

/// Replies with the payload unchanged. A stateless worker by default.
#[derive(Debug, Default)]
pub struct Echo;

impl Entity for Echo {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        let mut b = ctx.reply_buffer();
        b.extend_from_slice(message);
        ctx.reply(b);
        Ok(())
    }
}

/// An i64 counter: `add <n>` replies with the new value, `get` with the
/// current one (ASCII decimal). An unparsable command is answered with
/// `error: <reason>` and leaves the value as it was.
///
/// Event-sourced ([`persistent::PersistentEntity`]): an accepted `add <n>`
/// persists the event `n` (8 bytes, i64 little-endian) and replies with the
/// new value once it is durable; the snapshot is the value (8 bytes LE).
#[derive(Debug, Default)]
pub struct Counter {
    value: i64,
}

impl Counter {
    /// The current value.
    pub fn value(&self) -> i64 {
        self.value
    }

    fn decide(&self, message: &[u8]) -> Result<Option<i64>, String> {
        match std::str::from_utf8(message) {
            Err(_) => Err("error: command is not UTF-8".to_string()),
            Ok("get") => Ok(None),
            Ok(cmd) => match cmd.strip_prefix("add ") {
                None => Err(format!("error: unknown command `{}`", cmd.escape_debug())),
                Some(n) => match n.trim().parse::<i64>() {
                    Err(e) => Err(format!("error: bad number: {e}")),
                    Ok(n) => match self.value.checked_add(n) {
                        None => Err("error: overflow".to_string()),
                        Some(_) => Ok(Some(n)),
                    },
                },
            },
        }
    }
}

fn decode_i64(bytes: &[u8], what: &str) -> Result<i64, EntityError> {
    let b: [u8; 8] = bytes
        .try_into()
        .map_err(|_| EntityError::Failed(format!("{what} is {} bytes, not 8", bytes.len())))?;
    Ok(i64::from_le_bytes(b))
}

/// Replies `v` in decimal, written into a spare reply buffer of the core.
fn reply_i64(ctx: &mut persistent::PersistContext, v: i64) {
    // itoa: the same decimal text as `write!(b, "{v}")` without core::fmt's
    // formatting machinery (about 1 % of a data core's time per counter
    // add went to it).
    let mut b = ctx.reply_buffer();
    b.clear();
    b.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    ctx.reply(b);
}

impl persistent::PersistentEntity for Counter {
    fn on_command(
        &mut self,
        ctx: &mut persistent::PersistContext,
        command: &[u8],
    ) -> Result<(), EntityError> {
        match self.decide(command) {
            Err(reason) => ctx.reply(reason),
            Ok(None) => reply_i64(ctx, self.value),
            Ok(Some(n)) => ctx.persist(n.to_le_bytes().to_vec()),
        }
        Ok(())
    }

    fn on_event(
        &mut self,
        ctx: &mut persistent::PersistContext,
        event: &[u8],
    ) -> Result<(), EntityError> {
        let n = decode_i64(event, "counter event")?;
        self.value = self.value.wrapping_add(n);
        reply_i64(ctx, self.value);
        Ok(())
    }

    fn snapshot(&self) -> Vec<u8> {
        self.value.to_le_bytes().to_vec()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), EntityError> {
        self.value = decode_i64(snapshot, "counter snapshot")?;
        Ok(())
    }
}

/// Events between two snapshots of a durable built-in entity (count),
/// when the type's config does not say.
pub const DEFAULT_SNAPSHOT_EVERY: u64 = 100;

/// The factory of a built-in kind, with default settings.
pub fn builtin_factory(kind: crate::config::EntityKind) -> EntityFactory {
    builtin_factory_with(
        kind,
        DEFAULT_SNAPSHOT_EVERY,
        supervision::SupervisorSettings::default(),
    )
}

/// The factory of a built-in kind: `counter` is durable with a snapshot
/// every `snapshot_every` events (0: never); `aggregate` forwards to the
/// type and at the interval of `aggregate` (defaults when `None`: type
/// `aggregate_totals`, 1 s); every kind is supervised.
pub fn builtin_factory_with(
    kind: crate::config::EntityKind,
    snapshot_every: u64,
    supervisor: supervision::SupervisorSettings,
) -> EntityFactory {
    builtin_factory_full(kind, snapshot_every, supervisor, None)
}

/// As [`builtin_factory_with`], with the `aggregate` kind's target type and
/// flush interval.
pub fn builtin_factory_full(
    kind: crate::config::EntityKind,
    snapshot_every: u64,
    supervisor: supervision::SupervisorSettings,
    aggregate: Option<(String, Duration)>,
) -> EntityFactory {
    let inner: EntityFactory = match kind {
        crate::config::EntityKind::Echo => Arc::new(|_| Box::new(Echo)),
        crate::config::EntityKind::Aggregate => {
            let (to, every) = aggregate.unwrap_or_else(|| {
                (
                    aggregate::DEFAULT_TARGET_TYPE.to_string(),
                    aggregate::DEFAULT_INTERVAL,
                )
            });
            let to: Arc<str> = to.into();
            Arc::new(move |_| Box::new(Aggregate::new(to.clone(), every)))
        }
        crate::config::EntityKind::Counter => {
            // Held inline by its supervisor: one allocation per counter.
            return supervision::supervised_inline(
                Arc::new(move |_| persistent::Persistent::new(Counter::default(), snapshot_every)),
                supervisor,
            );
        }
    };
    supervision::supervised(inner, supervisor)
}

#[cfg(test)]
/// The pre-durability counter semantics, for command parsing tests.
#[derive(Default)]
struct CounterInMemory(Counter);

#[cfg(test)]
impl Entity for CounterInMemory {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        match self.0.decide(message) {
            Err(r) => ctx.reply(r),
            Ok(None) => ctx.reply(self.0.value.to_string()),
            Ok(Some(n)) => {
                self.0.value += n;
                ctx.reply(self.0.value.to_string())
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(e: &mut dyn Entity, msg: &str) -> String {
        let id = EntityId::new("x").unwrap();
        let mut services = EntityServices::default();
        let mut ctx = EntityContext::new(&id, &mut services);
        e.handle(&mut ctx, msg.as_bytes()).unwrap();
        String::from_utf8(ctx.take_reply().unwrap()).unwrap()
    }

    /// A durable counter on an in-memory journal with "none" semantics.
    struct Durable {
        host: persistent::Persistent<Counter>,
        services: EntityServices,
        id: EntityId,
        token: u64,
    }

    impl Durable {
        fn start(log: crate::persistence::CoreLog) -> Self {
            let mut services = EntityServices::new(
                0,
                crate::persistence::CoreJournal::with_log_installed(Box::new(log)),
            );
            let id = EntityId::new("x").unwrap();
            let mut host = persistent::Persistent::new(Counter::default(), 3);
            host.on_start(&mut EntityContext::new(&id, &mut services).with_type("counter", 1));
            Durable {
                host,
                services,
                id,
                token: 0,
            }
        }

        fn run(&mut self, msg: &str) -> String {
            self.token += 1;
            let mut ctx = EntityContext::new(&self.id, &mut self.services)
                .with_type("counter", 1)
                .with_reply_token(self.token);
            self.host.handle(&mut ctx, msg.as_bytes()).unwrap();
            // Under "none" the command is answered in the call (nothing
            // pending), else through a completion once durable.
            let direct = ctx.take_reply();
            let mut c = self.services.take_completions();
            match direct {
                Some(r) => {
                    assert!(c.is_empty(), "{msg}: answered twice");
                    String::from_utf8(r).unwrap()
                }
                None => {
                    assert_eq!(c.len(), 1, "{msg}");
                    String::from_utf8(c.remove(0).payload).unwrap()
                }
            }
        }
    }

    fn run_durable(e: &mut Durable, msg: &str) -> String {
        e.run(msg)
    }

    #[test]
    fn durable_counter_recovers_from_snapshot_and_events() {
        let dir = tempfile::tempdir().unwrap();
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let log = crate::persistence::CoreLog::open(&dir.path().join("node-a"), 0, &none).unwrap();
        let mut c = Durable::start(log);
        assert_eq!(run_durable(&mut c, "add 5"), "5");
        assert_eq!(run_durable(&mut c, "add -7"), "-2");
        for _ in 0..5 {
            run_durable(&mut c, "add 1");
        }
        assert_eq!(run_durable(&mut c, "get"), "3");
        assert!(run_durable(&mut c, "mul 2").starts_with("error: "));
        drop(c);
        let log = crate::persistence::CoreLog::open(&dir.path().join("node-a"), 0, &none).unwrap();
        let mut c = Durable::start(log);
        // 7 events, snapshot every 3: the snapshot holds 6, one event replays.
        assert_eq!(c.host.recovered_events(), 1);
        assert_eq!(run_durable(&mut c, "get"), "3");
        drop(c);
    }

    #[test]
    fn ask_ids_of_two_cores_never_meet() {
        let mut a = AskIds::for_core(0);
        let mut b = AskIds::for_core(1);
        let xa: Vec<AskId> = (0..3).map(|_| a.take()).collect();
        let xb: Vec<AskId> = (0..3).map(|_| b.take()).collect();
        assert!(xa.windows(2).all(|w| w[0] < w[1]), "increasing");
        assert!(xa.iter().all(|x| !xb.contains(x)), "{xa:?} {xb:?}");
        assert_eq!(xb[0].0 >> 48, 2);
    }

    #[test]
    fn counter_commands() {
        let mut c = CounterInMemory::default();
        assert_eq!(run(&mut c, "add 5"), "5");
        assert_eq!(run(&mut c, "add -7"), "-2");
        assert_eq!(run(&mut c, "get"), "-2");
        assert!(run(&mut c, "mul 2").starts_with("error: "));
        assert!(run(&mut c, "add x").starts_with("error: "));
        assert_eq!(run(&mut c, "get"), "-2");
    }

    #[test]
    fn echo_echoes() {
        assert_eq!(run(&mut Echo, "hi"), "hi");
    }
}
