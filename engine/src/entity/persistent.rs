//! Event-sourced (durable) entities with the semantics of Akka's
//! `PersistentActor` `persist` / `persistAsync`
//! (<https://doc.akka.io/docs/akka/current/persistence.html>).
//!
//! A [`PersistentEntity`] decides events in its command handler
//! ([`PersistContext::persist`], [`PersistContext::persist_all`],
//! [`PersistContext::persist_async`]). The events are appended to the
//! core's journal at once; their handler ([`PersistentEntity::on_event`])
//! runs only after they are durable under the node's policy, in the order
//! they were persisted. While an event from `persist`/`persist_all` is
//! pending, new commands are stashed and handled afterwards in arrival
//! order; `persist_async` events do not stash. The reply to a command (set
//! by its command handler or its events' handlers; the last one wins) goes
//! out after the handler of its last event ran, so a reply never speaks of
//! an event that is not durable.
//!
//! Recovery on start: latest snapshot ([`PersistentEntity::restore`]), then
//! the events after it through `on_event` (replies dropped). A snapshot is
//! saved every `snapshot_every` events ([`PersistentEntity::snapshot`]).
//! Persistence id: `{type_name}|{entity_id}`; writer epoch: the shard's
//! allocation generation, so an old incarnation of a moved shard is fenced
//! by the journal.

use std::collections::VecDeque;

use shardline_journal::{Lsn, PersistenceId, SequenceNr, WriterEpoch};

use super::{Entity, EntityContext, EntityError};
use crate::envelope::Status;
use crate::persistence::{LogError, LogErrorKind, RecoverStart, Recovered};

/// How an event was persisted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PersistMode {
    /// `persist`: new commands wait until its handler ran.
    Stash,
    /// `persistAsync`: new commands are handled meanwhile.
    Async,
}

/// What a command or event handler may ask.
#[derive(Default)]
pub struct PersistContext {
    events: Vec<(Vec<u8>, PersistMode)>,
    reply: Option<Vec<u8>>,
    recovering: bool,
    passivate: bool,
    /// Set by [`Self::refuse`]: the command's `EntityFailed` answer.
    refusal: Option<Vec<u8>>,
    /// A spare reply buffer of the core (see [`Self::reply_buffer`]).
    spare: Option<Vec<u8>>,
}

impl PersistContext {
    /// A context lent the core's spare reply buffer, if it has one.
    fn lent(ctx: &mut EntityContext<'_>) -> PersistContext {
        PersistContext {
            spare: Some(ctx.reply_buffer()),
            ..PersistContext::default()
        }
    }

    /// Gives the spare reply buffer back to the core when the handler did
    /// not take it.
    fn give_back(&mut self, ctx: &mut EntityContext<'_>) {
        if let Some(b) = self.spare.take() {
            ctx.return_reply_buffer(b);
        }
    }

    /// An empty buffer to write the reply into and pass to [`Self::reply`]:
    /// one the core reuses once an earlier reply was written out (see
    /// [`EntityContext::reply_buffer`]), else a new `Vec`.
    pub fn reply_buffer(&mut self) -> Vec<u8> {
        self.spare.take().unwrap_or_default()
    }

    /// Persists one event; new commands are stashed until its handler ran.
    pub fn persist(&mut self, event: impl Into<Vec<u8>>) {
        self.events.push((event.into(), PersistMode::Stash));
    }

    /// Persists events atomically in order (each with stashing).
    pub fn persist_all<I: IntoIterator<Item = Vec<u8>>>(&mut self, events: I) {
        for e in events {
            self.persist(e);
        }
    }

    /// Persists one event without stashing new commands; its handler still
    /// runs in persist order.
    pub fn persist_async(&mut self, event: impl Into<Vec<u8>>) {
        self.events.push((event.into(), PersistMode::Async));
    }

    /// Sets the reply of the current command (last call wins). Ignored
    /// during recovery.
    pub fn reply(&mut self, payload: impl Into<Vec<u8>>) {
        self.reply = Some(payload.into());
    }

    /// Whether events are being replayed (no replies, no persists).
    pub fn is_recovering(&self) -> bool {
        self.recovering
    }

    /// Asks to be stopped (passivated) after this message.
    pub fn passivate(&mut self) {
        self.passivate = true;
    }

    /// Refuses the current command: it is answered `EntityFailed` with
    /// `why`, nothing it persisted is appended, and the incarnation keeps
    /// running (unlike a handler error, which fails it). For input that is
    /// not a command at all (the typed host's undecodable bytes).
    pub(crate) fn refuse(&mut self, why: Vec<u8>) {
        self.refusal = Some(why);
    }
}

/// A user event-sourced entity. Events and snapshots are opaque bytes.
pub trait PersistentEntity: 'static {
    /// Handles a command: validates, then persists events or replies.
    ///
    /// # Errors
    /// [`EntityError`]: the command fails (sender gets `EntityFailed`).
    fn on_command(&mut self, ctx: &mut PersistContext, command: &[u8]) -> Result<(), EntityError>;

    /// Applies one event to the state (after it is durable, and during
    /// recovery); may reply.
    ///
    /// # Errors
    /// [`EntityError`]: the incarnation fails (an undecodable event).
    fn on_event(&mut self, ctx: &mut PersistContext, event: &[u8]) -> Result<(), EntityError>;

    /// The state as bytes.
    fn snapshot(&self) -> Vec<u8>;

    /// Replaces the state with a snapshot.
    ///
    /// # Errors
    /// [`EntityError`] when the bytes are not a snapshot of this type.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), EntityError>;
}

struct InFlight {
    lsn: Lsn,
    event: Vec<u8>,
    mode: PersistMode,
    command: u64,
}

struct PendingCommand {
    id: u64,
    token: Option<u64>,
    reply: Option<Vec<u8>>,
    remaining: usize,
}

/// What a durable entity holds only while it has work: events in flight,
/// the commands waiting for them or stashed, a recovery read in flight or
/// to redo, or the reason recovery failed. An idle entity has none of it
/// (one null pointer): across a million idle entities the queue headers
/// and the persistence id were most of their memory.
#[derive(Default)]
struct Busy {
    in_flight: VecDeque<InFlight>,
    commands: VecDeque<PendingCommand>,
    next_command: u64,
    stashed: VecDeque<(Vec<u8>, Option<u64>)>,
    /// `persist` events in flight (commands are stashed while above 0).
    stashing: usize,
    /// The ticket of a recovery read in flight (commands are stashed).
    recovering: Option<u64>,
    /// The journal was unavailable: recover again (the events after the
    /// last handled one) before the next command.
    needs_recovery: bool,
    /// Recovery failed for good: every command fails with this.
    failed: Option<String>,
}

impl Busy {
    /// Nothing pending and nothing to remember: the entity is idle.
    fn is_idle(&self) -> bool {
        self.in_flight.is_empty()
            && self.commands.is_empty()
            && self.stashed.is_empty()
            && self.stashing == 0
            && self.recovering.is_none()
            && !self.needs_recovery
            && self.failed.is_none()
    }
}

/// Hosts a [`PersistentEntity`] as an [`Entity`]: journal appends,
/// stashing, deferred replies, recovery and snapshots.
///
/// An idle incarnation keeps only its state, its sequence numbers and,
/// once it has events, its persistence id (`{type_name}|{entity_id}`, one
/// pointer to the journal's shared copy: no lookup per command);
/// everything a command in progress needs is allocated when it starts and
/// freed when it is done, and the writer epoch (the shard's allocation
/// generation, fixed for an incarnation) is read from the context then. The state `E` is held inline (a built-in type is one
/// allocation with its host); the default, a boxed `dyn PersistentEntity`,
/// hosts any.
pub struct Persistent<E: PersistentEntity = Box<dyn PersistentEntity>> {
    inner: E,
    seq: u64,
    /// The persistence id, kept once the entity has events (then it is
    /// the journal's copy) or while it is busy; derived from the context
    /// when absent.
    pid: Option<PersistenceId>,
    busy: Option<Box<Busy>>,
    /// Events between snapshots (0: never; saturated at `u32::MAX`).
    snapshot_every: u32,
    /// Events handled since the last snapshot (saturating).
    since_snapshot: u32,
    /// Events replayed at the last recovery (saturating).
    recovered_events: u32,
    /// Being stopped (`on_stopping`, `on_stop`): no new recovery.
    stopping: bool,
}

/// Frees an empty queue's buffer (a drained `VecDeque` keeps its capacity).
fn release_if_drained<T>(q: &mut VecDeque<T>) {
    if q.is_empty() && q.capacity() > 0 {
        *q = VecDeque::new();
    }
}

/// The persistence id of the entity `ctx` is about:
/// `{type_name}|{entity_id}`: the journal's copy when it has one (shared:
/// no allocation), else a new one (one allocation).
fn persistence_id(ctx: &mut EntityContext<'_>) -> Result<PersistenceId, EntityError> {
    let (t, id) = (
        ctx.type_name().as_bytes(),
        ctx.self_id().as_str().as_bytes(),
    );
    let len = t.len() + 1 + id.len();
    let mut buf = [0u8; 128];
    if len <= buf.len() {
        buf[..t.len()].copy_from_slice(t);
        buf[t.len()] = b'|';
        buf[t.len() + 1..len].copy_from_slice(id);
        if let Ok(s) = std::str::from_utf8(&buf[..len]) {
            if let Some(p) = ctx.journal().ok().and_then(|l| l.persistence_id(s)) {
                return Ok(p);
            }
        }
    }
    PersistenceId::concat(&[ctx.type_name(), "|", ctx.self_id().as_str()])
        .map_err(|e| EntityError::Failed(format!("persistence id: {e}")))
}

/// The writer epoch of the incarnation `ctx` is about.
fn epoch_of(ctx: &EntityContext<'_>) -> WriterEpoch {
    WriterEpoch(ctx.writer_epoch())
}

/// Appends `event` of `pid` as the event after `*seq` (advanced on
/// success) with `epoch`, and tells the context its LSN.
fn append_one(
    ctx: &mut EntityContext<'_>,
    pid: &PersistenceId,
    seq: &mut u64,
    epoch: WriterEpoch,
    event: &[u8],
) -> Result<Lsn, EntityError> {
    let next = *seq + 1;
    let lsn = ctx
        .journal()
        .map(|l| l.append(pid, SequenceNr(next), epoch, event))
        .and_then(|r| r)
        .map_err(|e| EntityError::Failed(format!("journal: {e}")))?;
    *seq = next;
    ctx.note_appended(lsn);
    Ok(lsn)
}

/// A boxed entity is one: its calls are forwarded.
impl<T: PersistentEntity + ?Sized> PersistentEntity for Box<T> {
    fn on_command(&mut self, ctx: &mut PersistContext, command: &[u8]) -> Result<(), EntityError> {
        (**self).on_command(ctx, command)
    }

    fn on_event(&mut self, ctx: &mut PersistContext, event: &[u8]) -> Result<(), EntityError> {
        (**self).on_event(ctx, event)
    }

    fn snapshot(&self) -> Vec<u8> {
        (**self).snapshot()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), EntityError> {
        (**self).restore(snapshot)
    }
}

impl<E: PersistentEntity> Persistent<E> {
    /// Wraps `inner`; a snapshot every `snapshot_every` events (0: never;
    /// above `u32::MAX` it is `u32::MAX`).
    pub fn new(inner: E, snapshot_every: u64) -> Self {
        Persistent {
            inner,
            seq: 0,
            pid: None,
            snapshot_every: u32::try_from(snapshot_every).unwrap_or(u32::MAX),
            since_snapshot: 0,
            busy: None,
            recovered_events: 0,
            stopping: false,
        }
    }

    /// The last sequence number used.
    pub fn sequence_nr(&self) -> u64 {
        self.seq
    }

    /// Events replayed at the last recovery (count).
    pub fn recovered_events(&self) -> u64 {
        u64::from(self.recovered_events)
    }

    /// Commands stashed now (count).
    pub fn stashed(&self) -> usize {
        self.busy.as_ref().map_or(0, |b| b.stashed.len())
    }

    /// The pending work, allocated on first need.
    fn busy(&mut self) -> &mut Busy {
        self.busy.get_or_insert_with(Box::default)
    }

    fn failed(&self) -> Option<&str> {
        self.busy.as_ref().and_then(|b| b.failed.as_deref())
    }

    fn recovering(&self) -> Option<u64> {
        self.busy.as_ref().and_then(|b| b.recovering)
    }

    fn needs_recovery(&self) -> bool {
        self.busy.as_ref().is_some_and(|b| b.needs_recovery)
    }

    fn stashing(&self) -> usize {
        self.busy.as_ref().map_or(0, |b| b.stashing)
    }

    fn in_flight_len(&self) -> usize {
        self.busy.as_ref().map_or(0, |b| b.in_flight.len())
    }

    fn front_lsn(&self) -> Option<Lsn> {
        self.busy
            .as_ref()
            .and_then(|b| b.in_flight.front())
            .map(|f| f.lsn)
    }

    /// The persistence id: the one kept (taken out: give it back with
    /// [`Self::keep_pid`]), else derived from `ctx`.
    fn take_pid(&mut self, ctx: &mut EntityContext<'_>) -> Result<PersistenceId, EntityError> {
        match self.pid.take() {
            Some(p) => Ok(p),
            None => persistence_id(ctx),
        }
    }

    /// Keeps `pid` once the entity has events (the journal holds the same
    /// string then, so keeping it costs one pointer) or while it is busy;
    /// an entity without events drops it (activating a million fresh ids
    /// with reads keeps no id copy each).
    fn keep_pid(&mut self, pid: PersistenceId) {
        if self.seq > 0 || self.busy.is_some() {
            self.pid.get_or_insert(pid);
        }
    }

    /// Frees the pending work's state once nothing is pending.
    fn settle(&mut self) {
        if self.busy.as_ref().is_some_and(|b| b.is_idle()) {
            self.busy = None;
            if self.seq == 0 {
                self.pid = None;
            }
        }
    }

    /// Starts (or, after the journal was unavailable, resumes) recovery:
    /// the latest snapshot newer than the last handled event, then the
    /// events after it. A backend that reads on another thread answers
    /// later ([`Self::on_durable`] polls it); commands are stashed
    /// meanwhile.
    fn start_recovery(
        &mut self,
        ctx: &mut EntityContext<'_>,
        pid: &PersistenceId,
    ) -> Result<(), EntityError> {
        let (after, epoch) = (self.seq, epoch_of(ctx));
        let start = ctx
            .journal()
            .map(|l| l.recover_start(pid, epoch, after))
            .map_err(|e| EntityError::Failed(format!("recovery of {}: {e}", pid.as_str())))?;
        match start {
            RecoverStart::Ready(Ok(rec)) => self.apply_recovered(rec),
            RecoverStart::Ready(Err(e)) => self.recovery_failed(ctx, pid, e),
            RecoverStart::Pending(ticket) => {
                self.busy().recovering = Some(ticket);
                ctx.await_durable();
                Ok(())
            }
        }
    }

    /// As [`Self::start_recovery`], with the persistence id kept while
    /// busy or derived.
    fn recover(&mut self, ctx: &mut EntityContext<'_>) -> Result<(), EntityError> {
        let pid = self.take_pid(ctx)?;
        let r = self.start_recovery(ctx, &pid);
        self.keep_pid(pid);
        r
    }

    /// Applies a recovery read on top of the state (which holds the events
    /// up to `self.seq`).
    fn apply_recovered(&mut self, rec: Recovered) -> Result<(), EntityError> {
        let mut pc = PersistContext {
            recovering: true,
            ..PersistContext::default()
        };
        if let Some((seq, data)) = &rec.snapshot {
            if *seq > self.seq {
                self.inner.restore(data)?;
                self.seq = *seq;
            }
        }
        let mut n = 0;
        for (seq, ev) in &rec.events {
            if *seq <= self.seq {
                continue;
            }
            self.inner.on_event(&mut pc, ev)?;
            self.seq = *seq;
            n += 1;
        }
        // Sequence numbers taken without an event (a claim row).
        self.seq = self.seq.max(rec.highest);
        self.recovered_events = u32::try_from(n).unwrap_or(u32::MAX);
        self.since_snapshot = self
            .since_snapshot
            .saturating_add(u32::try_from(n).unwrap_or(u32::MAX));
        Ok(())
    }

    /// A recovery read failed: the stashed commands get its status; an
    /// unavailable journal leaves the entity waiting to recover on its
    /// next command, anything else fails the incarnation.
    fn recovery_failed(
        &mut self,
        ctx: &mut EntityContext<'_>,
        pid: &PersistenceId,
        e: LogError,
    ) -> Result<(), EntityError> {
        let why = format!("recovery of {}: {e}", pid.as_str());
        if let Some(b) = self.busy.as_mut() {
            for (_, t) in b.stashed.drain(..) {
                if let Some(t) = t {
                    ctx.complete(t, e.status(), why.as_bytes().to_vec());
                }
            }
        }
        if e.kind == LogErrorKind::Unavailable {
            self.busy().needs_recovery = true;
            Ok(())
        } else {
            self.busy().failed = Some(why.clone());
            Err(EntityError::Failed(why))
        }
    }

    /// The journal refused an append of this entity (the database was
    /// unavailable, or a newer incarnation fenced this one): the commands
    /// in flight get the refusal's status, the sequence number goes back
    /// to the last handled event, and (unavailable) the entity recovers
    /// what the database holds before the stashed commands run.
    fn on_rejected(
        &mut self,
        ctx: &mut EntityContext<'_>,
        pid: &PersistenceId,
        e: LogError,
    ) -> Result<(), EntityError> {
        self.seq -= self.in_flight_len() as u64;
        if let Some(b) = self.busy.as_mut() {
            b.in_flight.clear();
            b.stashing = 0;
            for c in b.commands.drain(..) {
                if let Some(t) = c.token {
                    ctx.complete(t, e.status(), e.message.as_bytes().to_vec());
                }
            }
        }
        if e.kind != LogErrorKind::Unavailable {
            let why = e.message.clone();
            self.recovery_failed(ctx, pid, e)?;
            return Err(EntityError::Failed(why));
        }
        self.busy().needs_recovery = true;
        if self.stashed() > 0 && !self.stopping {
            self.busy().needs_recovery = false;
            self.start_recovery(ctx, pid)?;
        }
        Ok(())
    }

    /// Runs the command handler (a passivation it asks for is passed on);
    /// returns what it persisted and replied.
    fn run_command_handler(
        &mut self,
        ctx: &mut EntityContext<'_>,
        command: &[u8],
    ) -> Result<PersistContext, EntityError> {
        let mut pc = PersistContext::lent(ctx);
        let handled = self.inner.on_command(&mut pc, command);
        pc.give_back(ctx);
        handled?;
        if pc.passivate {
            ctx.passivate();
        }
        Ok(pc)
    }

    /// Runs the handler of a durable `event` (a passivation it asks for is
    /// passed on); returns the reply it set, if any.
    fn run_event_handler(
        &mut self,
        ctx: &mut EntityContext<'_>,
        event: &[u8],
    ) -> Result<Option<Vec<u8>>, EntityError> {
        let mut pc = PersistContext::lent(ctx);
        let handled = self.inner.on_event(&mut pc, event);
        pc.give_back(ctx);
        handled?;
        if pc.passivate {
            ctx.passivate();
        }
        Ok(pc.reply)
    }

    /// Runs one command when nothing is pending and the journal makes an
    /// append durable at once ([`crate::persistence::EventLog::durable_on_append`]):
    /// each event is appended and its handler run in order, and the
    /// command answered through the context, as the queued path would
    /// (same order of handlers, same reply, same snapshots) without
    /// allocating its pending-work state.
    fn run_command_now(
        &mut self,
        ctx: &mut EntityContext<'_>,
        command: &[u8],
    ) -> Result<(), EntityError> {
        let mut pc = self.run_command_handler(ctx, command)?;
        if let Some(why) = pc.refusal.take() {
            if let Some(t) = ctx.defer_reply() {
                ctx.complete(t, Status::EntityFailed, why);
            }
            return Ok(());
        }
        let mut reply = pc.reply.take();
        if !pc.events.is_empty() {
            let pid = self.take_pid(ctx)?;
            let r = self.append_now(ctx, &pid, pc.events, &mut reply);
            self.keep_pid(pid);
            r?;
        }
        ctx.reply(reply.unwrap_or_default());
        Ok(())
    }

    /// Appends `events` of `pid` one by one, each followed by its handler
    /// (durable at once: see [`Self::run_command_now`]); an event handler's
    /// reply replaces `reply`.
    fn append_now(
        &mut self,
        ctx: &mut EntityContext<'_>,
        pid: &PersistenceId,
        events: Vec<(Vec<u8>, PersistMode)>,
        reply: &mut Option<Vec<u8>>,
    ) -> Result<(), EntityError> {
        let epoch = epoch_of(ctx);
        for (event, _) in events {
            append_one(ctx, pid, &mut self.seq, epoch, &event)?;
            if let Some(r) = self.run_event_handler(ctx, &event)? {
                *reply = Some(r);
            }
            self.since_snapshot = self.since_snapshot.saturating_add(1);
            self.maybe_snapshot(ctx, pid);
        }
        Ok(())
    }

    /// Runs one command; its events (if any) are appended with `pid` (the
    /// caller's, else the one kept while busy or derived).
    fn run_command(
        &mut self,
        ctx: &mut EntityContext<'_>,
        command: &[u8],
        token: Option<u64>,
        pid: Option<&PersistenceId>,
    ) -> Result<(), EntityError> {
        let pc = self.run_command_handler(ctx, command)?;
        if let Some(why) = pc.refusal {
            if let Some(t) = token {
                ctx.complete(t, Status::EntityFailed, why);
            }
            return Ok(());
        }
        if pc.events.is_empty() {
            if let Some(t) = token {
                ctx.complete(t, Status::Ok, pc.reply.unwrap_or_default());
            }
            return Ok(());
        }
        match pid {
            Some(pid) => self.append_events(ctx, pid, pc, token),
            None => {
                let pid = self.take_pid(ctx)?;
                let r = self.append_events(ctx, &pid, pc, token);
                self.keep_pid(pid);
                r
            }
        }
    }

    /// Appends the events a command handler persisted and records the
    /// command as waiting for them.
    fn append_events(
        &mut self,
        ctx: &mut EntityContext<'_>,
        pid: &PersistenceId,
        pc: PersistContext,
        token: Option<u64>,
    ) -> Result<(), EntityError> {
        let n = pc.events.len();
        let b = self.busy.get_or_insert_with(Box::default);
        let id = b.next_command;
        b.next_command = b.next_command.wrapping_add(1);
        let epoch = epoch_of(ctx);
        for (event, mode) in pc.events {
            let lsn = append_one(ctx, pid, &mut self.seq, epoch, &event)?;
            if mode == PersistMode::Stash {
                b.stashing += 1;
            }
            b.in_flight.push_back(InFlight {
                lsn,
                event,
                mode,
                command: id,
            });
        }
        b.commands.push_back(PendingCommand {
            id,
            token,
            reply: pc.reply,
            remaining: n,
        });
        // The caller asks for the durability notice if events are still in
        // flight once it ran what is durable already ([`Entity::handle`],
        // `advance_with`): under "none" nothing is, and asking would queue
        // a waiter and wake the core's durability task for every command.
        Ok(())
    }

    /// Runs the handlers of the events durable up to `durable`, answers the
    /// commands they complete, then handles stashed commands.
    fn advance(&mut self, ctx: &mut EntityContext<'_>, durable: Lsn) -> Result<(), EntityError> {
        if self.busy.is_none() {
            // Nothing in flight, nothing stashed: nothing to do.
            return Ok(());
        }
        let pid = self.take_pid(ctx)?;
        let r = self.advance_with(ctx, &pid, durable);
        self.keep_pid(pid);
        if r.is_ok() {
            self.settle();
        }
        r
    }

    fn advance_with(
        &mut self,
        ctx: &mut EntityContext<'_>,
        pid: &PersistenceId,
        durable: Lsn,
    ) -> Result<(), EntityError> {
        loop {
            while let Some(lsn) = self.front_lsn().filter(|l| *l <= durable) {
                if let Some(e) = ctx.journal().map(|l| l.rejected(pid, lsn)).ok().flatten() {
                    return self.on_rejected(ctx, pid, e);
                }
                let Some(f) = self.busy.as_mut().and_then(|b| b.in_flight.pop_front()) else {
                    break;
                };
                let event_reply = self.run_event_handler(ctx, &f.event)?;
                let b = self.busy();
                if f.mode == PersistMode::Stash {
                    b.stashing -= 1;
                }
                if let Some(c) = b.commands.iter_mut().find(|c| c.id == f.command) {
                    if event_reply.is_some() {
                        c.reply = event_reply;
                    }
                    c.remaining -= 1;
                }
                while b.commands.front().is_some_and(|c| c.remaining == 0) {
                    if let Some(c) = b.commands.pop_front() {
                        if let Some(t) = c.token {
                            ctx.complete(t, Status::Ok, c.reply.unwrap_or_default());
                        }
                    }
                }
                self.since_snapshot = self.since_snapshot.saturating_add(1);
                self.maybe_snapshot(ctx, pid);
            }
            if self.stashing() > 0 || self.stashed() == 0 || self.recovering().is_some() {
                break;
            }
            if self.needs_recovery() {
                if self.stopping {
                    break;
                }
                self.busy().needs_recovery = false;
                self.start_recovery(ctx, pid)?;
                if self.recovering().is_some() || self.needs_recovery() {
                    break;
                }
            }
            while self.stashing() == 0 {
                let Some((cmd, token)) = self.busy.as_mut().and_then(|b| b.stashed.pop_front())
                else {
                    break;
                };
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.run_command(ctx, &cmd, token, Some(pid))
                }));
                match ran {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        if let Some(t) = token {
                            ctx.complete(t, Status::EntityFailed, e.to_string().into_bytes());
                        }
                    }
                    Err(payload) => {
                        // The command's reply token was taken off the queue
                        // and is only here: answer it before the panic goes
                        // on to fail the incarnation (the supervisor or the
                        // host catches it), or its sender would wait out
                        // its whole ask timeout for an answer nobody gives.
                        if let Some(t) = token {
                            let why = format!(
                                "command handler panicked: {}",
                                super::panic_text(payload.as_ref())
                            );
                            ctx.complete(t, Status::EntityFailed, why.into_bytes());
                        }
                        std::panic::resume_unwind(payload);
                    }
                }
            }
            // Under "none" the new appends are durable already.
            let d = ctx.journal().map(|l| l.durable_lsn()).unwrap_or(durable);
            if self.front_lsn().is_none_or(|l| l > d) {
                break;
            }
        }
        if self.in_flight_len() > 0 {
            ctx.await_durable();
        }
        // A busy entity that waits (a recovery read, a stash) keeps no
        // drained queue buffers: a drained `VecDeque` keeps its capacity.
        if let Some(b) = self.busy.as_mut() {
            release_if_drained(&mut b.in_flight);
            release_if_drained(&mut b.commands);
            release_if_drained(&mut b.stashed);
        }
        Ok(())
    }

    fn maybe_snapshot(&mut self, ctx: &mut EntityContext<'_>, pid: &PersistenceId) {
        if self.snapshot_every == 0 || self.since_snapshot < self.snapshot_every {
            return;
        }
        // Only events whose handlers ran are in the state.
        let seq = self.seq - self.in_flight_len() as u64;
        let data = self.inner.snapshot();
        let epoch = epoch_of(ctx);
        match ctx
            .journal()
            .map(|l| l.save_snapshot(pid, SequenceNr(seq), epoch, &data))
            .and_then(|r| r)
        {
            Ok(()) => self.since_snapshot = 0,
            Err(e) => tracing::warn!(pid = pid.as_str(), error = %e, "snapshot not saved"),
        }
    }

    /// Answers every command not answered yet with `EntityFailed` and
    /// `why`: those with events in flight and the stashed ones.
    fn fail_pending(&mut self, ctx: &mut EntityContext<'_>, why: &str) {
        self.answer_pending(
            ctx,
            (Status::EntityFailed, why),
            (Status::EntityFailed, why),
        );
    }

    /// Answers the commands with events in flight with `in_flight` and the
    /// stashed ones (never handled) with `stashed` (status, message).
    fn answer_pending(
        &mut self,
        ctx: &mut EntityContext<'_>,
        in_flight: (Status, &str),
        stashed: (Status, &str),
    ) {
        let Some(b) = self.busy.as_mut() else {
            return;
        };
        for c in b.commands.drain(..) {
            if let Some(t) = c.token {
                ctx.complete(t, in_flight.0, in_flight.1.as_bytes().to_vec());
            }
        }
        for (_, t) in b.stashed.drain(..) {
            if let Some(t) = t {
                ctx.complete(t, stashed.0, stashed.1.as_bytes().to_vec());
            }
        }
        b.in_flight.clear();
        b.stashing = 0;
    }
}

impl<E: PersistentEntity> Entity for Persistent<E> {
    fn on_start(&mut self, ctx: &mut EntityContext<'_>) {
        let pid = match persistence_id(ctx) {
            Ok(p) => p,
            Err(EntityError::Failed(why)) => {
                self.busy().failed = Some(why);
                ctx.passivate();
                return;
            }
        };
        let r = self.start_recovery(ctx, &pid);
        self.keep_pid(pid);
        if let Err(e) = r {
            tracing::error!(entity = %ctx.self_id(), error = %e, "recovery failed");
            self.busy().failed = Some(e.to_string());
            ctx.passivate();
        }
    }

    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        if let Some(why) = self.failed() {
            return Err(EntityError::Failed(format!("recovery failed: {why}")));
        }
        if self.busy.is_none()
            && ctx
                .journal()
                .map(|l| l.durable_on_append())
                .unwrap_or(false)
        {
            // Nothing pending and appends durable at once: the command's
            // events are appended, their handlers run and the command is
            // answered now (no deferred reply).
            return self.run_command_now(ctx, message);
        }
        let token = ctx.defer_reply();
        if self.stashing() > 0 || self.recovering().is_some() {
            self.busy().stashed.push_back((message.to_vec(), token));
            return Ok(());
        }
        if self.needs_recovery() {
            // The journal was unavailable: read what it holds first.
            let b = self.busy();
            b.stashed.push_back((message.to_vec(), token));
            b.needs_recovery = false;
            self.recover(ctx)?;
            if self.recovering().is_none() && !self.needs_recovery() {
                let d = ctx.journal().map(|l| l.durable_lsn()).unwrap_or(Lsn(0));
                self.advance(ctx, d)?;
            }
            return Ok(());
        }
        self.run_command(ctx, message, token, None)?;
        // Under "none" (or a durable LSN already past), run handlers now;
        // else wait for the journal's notice.
        if let Some(lsn) = self.front_lsn() {
            let d = ctx.journal().map(|l| l.durable_lsn()).unwrap_or(Lsn(0));
            if lsn <= d {
                self.advance(ctx, d)?;
            } else {
                ctx.await_durable();
            }
        }
        Ok(())
    }

    fn on_durable(
        &mut self,
        ctx: &mut EntityContext<'_>,
        durable_lsn: u64,
    ) -> Result<(), EntityError> {
        if let Some(ticket) = self.recovering() {
            let pid = self.take_pid(ctx)?;
            match ctx.journal().map(|l| l.recover_poll(&pid, ticket)) {
                Ok(None) => {
                    self.keep_pid(pid);
                    ctx.await_durable();
                    return Ok(());
                }
                Ok(Some(res)) => {
                    self.busy().recovering = None;
                    let res = match res {
                        Ok(rec) => self.apply_recovered(rec),
                        Err(e) => self.recovery_failed(ctx, &pid, e),
                    };
                    self.keep_pid(pid);
                    if let Err(e) = res {
                        self.fail_pending(ctx, &e.to_string());
                        return Err(e);
                    }
                }
                Err(e) => {
                    self.busy().recovering = None;
                    self.fail_pending(ctx, &e);
                    return Err(EntityError::Failed(e));
                }
            }
        }
        match self.advance(ctx, Lsn(durable_lsn)) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.fail_pending(ctx, &e.to_string());
                Err(e)
            }
        }
    }

    fn on_stopping(&mut self) -> bool {
        // Events in flight are in the journal: the runtime keeps this
        // incarnation until they have an outcome (`on_durable` runs their
        // handlers and answers their commands; stashed commands run then
        // too), so their commands are answered truthfully and a hand-off
        // completes only after they are durable. A recovery read in flight
        // (the database's reader thread) with commands stashed behind it
        // keeps it too, until the read has an outcome: the commands then
        // run on the recovered state (and their events are durable before
        // the hand-off completes), or get the read's error; this is
        // Akka's hand-off stop message waiting for the entity, without
        // dropping its stash. A read with nothing stashed is dropped by
        // `on_stop`.
        self.stopping = true;
        match self.recovering() {
            Some(_) => self.stashed() > 0,
            None => self.in_flight_len() > 0,
        }
    }

    fn may_stop_waiting(&mut self) -> bool {
        // A read that takes longer than the stop wait (a queue of reads, a
        // database that does not answer) does not hold the hand-off: the
        // stashed commands were never handled (`on_stop` answers them
        // `Unavailable`). Appends in flight are waited for.
        self.recovering().is_some() && self.in_flight_len() == 0
    }

    fn on_stop(&mut self, ctx: &mut EntityContext<'_>) {
        self.stopping = true;
        if let Some(t) = self.busy.as_mut().and_then(|b| b.recovering.take()) {
            if let Ok(l) = ctx.journal() {
                l.recover_forget(t);
            }
        }
        // Stashed commands were never handled: safe to retry (a client
        // retries them at the shard's new home).
        self.answer_pending(
            ctx,
            (Status::EntityFailed, "entity stopped"),
            (
                Status::Unavailable,
                "entity stopped before it handled the command: not applied, safe to retry",
            ),
        );
        self.settle();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistence::{EventLog, Recovered};
    use shardline_core::ids::EntityId;
    use std::collections::HashMap;

    /// An in-memory log whose durable LSN the test moves by hand.
    #[derive(Default)]
    struct MemLog {
        events: HashMap<String, Vec<(u64, Vec<u8>)>>,
        snaps: HashMap<String, (u64, Vec<u8>)>,
        next: u64,
        durable: std::rc::Rc<std::cell::Cell<u64>>,
        /// Reads answer `Pending` and complete once `read_done` is set
        /// (as the database's reader thread does).
        async_reads: bool,
        read_done: std::rc::Rc<std::cell::Cell<bool>>,
        pending_read: Option<(u64, Recovered)>,
        /// Every append durable at once (the local journal under "none").
        durable_on_append: bool,
    }

    impl EventLog for MemLog {
        fn append(
            &mut self,
            pid: &PersistenceId,
            seq: SequenceNr,
            _epoch: WriterEpoch,
            payload: &[u8],
        ) -> Result<Lsn, String> {
            self.next += 1;
            self.events
                .entry(pid.as_str().to_string())
                .or_default()
                .push((seq.0, payload.to_vec()));
            Ok(Lsn(self.next))
        }
        fn recover(&mut self, pid: &PersistenceId, _: WriterEpoch) -> Result<Recovered, String> {
            let snap = self.snaps.get(pid.as_str()).cloned();
            let from = snap.as_ref().map_or(0, |s| s.0);
            let events = self
                .events
                .get(pid.as_str())
                .map(|v| v.iter().filter(|(s, _)| *s > from).cloned().collect())
                .unwrap_or_default();
            Ok(Recovered {
                snapshot: snap,
                events,
                highest: 0,
            })
        }
        fn save_snapshot(
            &mut self,
            pid: &PersistenceId,
            seq: SequenceNr,
            _epoch: WriterEpoch,
            data: &[u8],
        ) -> Result<(), String> {
            self.snaps
                .insert(pid.as_str().to_string(), (seq.0, data.to_vec()));
            Ok(())
        }
        fn highest_sequence_nr(&self, pid: &PersistenceId) -> u64 {
            self.events
                .get(pid.as_str())
                .and_then(|v| v.last())
                .map_or(0, |e| e.0)
        }
        fn durable_lsn(&self) -> Lsn {
            if self.durable_on_append {
                Lsn(self.next)
            } else {
                Lsn(self.durable.get())
            }
        }
        fn durable_on_append(&self) -> bool {
            self.durable_on_append
        }
        fn wait_durable(&mut self, lsn: Lsn) -> Result<(), String> {
            self.durable.set(self.durable.get().max(lsn.0));
            Ok(())
        }
        fn recover_start(
            &mut self,
            pid: &PersistenceId,
            epoch: WriterEpoch,
            after_seq: u64,
        ) -> RecoverStart {
            let rec = match self.recover(pid, epoch) {
                Ok(r) => r.after(after_seq),
                Err(e) => return RecoverStart::Ready(Err(LogError::failed(e))),
            };
            if !self.async_reads {
                return RecoverStart::Ready(Ok(rec));
            }
            self.pending_read = Some((7, rec));
            RecoverStart::Pending(7)
        }
        fn recover_poll(
            &mut self,
            _pid: &PersistenceId,
            ticket: u64,
        ) -> Option<Result<Recovered, LogError>> {
            if !self.read_done.get() || self.pending_read.as_ref().is_none_or(|r| r.0 != ticket) {
                return None;
            }
            self.pending_read.take().map(|(_, r)| Ok(r))
        }
    }

    /// Records the order of command and event handlers; `s:X` persists
    /// event X, `a:X` persist_async X, `r` replies without events.
    #[derive(Default)]
    struct Recorder {
        log: std::rc::Rc<std::cell::RefCell<Vec<String>>>,
    }

    impl PersistentEntity for Recorder {
        fn on_command(&mut self, ctx: &mut PersistContext, c: &[u8]) -> Result<(), EntityError> {
            let c = String::from_utf8_lossy(c).to_string();
            self.log.borrow_mut().push(format!("cmd {c}"));
            for part in c.split(',') {
                if let Some(e) = part.strip_prefix("s:") {
                    ctx.persist(e.as_bytes().to_vec());
                } else if let Some(e) = part.strip_prefix("a:") {
                    ctx.persist_async(e.as_bytes().to_vec());
                } else {
                    ctx.reply(format!("r {c}"));
                }
            }
            Ok(())
        }
        fn on_event(&mut self, ctx: &mut PersistContext, e: &[u8]) -> Result<(), EntityError> {
            let e = String::from_utf8_lossy(e).to_string();
            if !ctx.is_recovering() {
                self.log.borrow_mut().push(format!("evt {e}"));
                ctx.reply(format!("done {e}"));
            }
            Ok(())
        }
        fn snapshot(&self) -> Vec<u8> {
            Vec::new()
        }
        fn restore(&mut self, _: &[u8]) -> Result<(), EntityError> {
            Ok(())
        }
    }

    struct Harness {
        host: Persistent<Recorder>,
        services: crate::entity::EntityServices,
        id: EntityId,
        log: std::rc::Rc<std::cell::RefCell<Vec<String>>>,
        durable: std::rc::Rc<std::cell::Cell<u64>>,
        next_token: u64,
    }

    impl Harness {
        fn new() -> Self {
            Harness::with_log(MemLog::default())
        }
        /// A harness whose journal reads on another thread: recovery
        /// completes once `read_done` is set.
        fn reading() -> (Self, std::rc::Rc<std::cell::Cell<bool>>) {
            let mem = MemLog {
                async_reads: true,
                ..MemLog::default()
            };
            let done = mem.read_done.clone();
            (Harness::with_log(mem), done)
        }
        fn with_log(mem: MemLog) -> Self {
            let durable = mem.durable.clone();
            let mut services = crate::entity::EntityServices::new(
                0,
                crate::persistence::CoreJournal::with_log_installed(Box::new(mem)),
            );
            let log = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
            let inner = Recorder { log: log.clone() };
            let mut host = Persistent::new(inner, 0);
            let id = EntityId::new("e1").unwrap();
            let mut ctx = EntityContext::new(&id, &mut services).with_type("rec", 1);
            host.on_start(&mut ctx);
            let _ = services.take_completions();
            Harness {
                host,
                services,
                id,
                log,
                durable,
                next_token: 1,
            }
        }
        fn send(&mut self, cmd: &str) -> u64 {
            let t = self.next_token;
            self.next_token += 1;
            let mut ctx = EntityContext::new(&self.id, &mut self.services)
                .with_type("rec", 1)
                .with_reply_token(t);
            self.host.handle(&mut ctx, cmd.as_bytes()).unwrap();
            assert!(ctx.reply_deferred());
            t
        }
        fn make_durable(&mut self, lsn: u64) {
            self.durable.set(lsn);
            let mut ctx = EntityContext::new(&self.id, &mut self.services).with_type("rec", 1);
            self.host.on_durable(&mut ctx, lsn).unwrap();
        }
        fn stop(&mut self) {
            let mut ctx = EntityContext::new(&self.id, &mut self.services).with_type("rec", 1);
            self.host.on_stop(&mut ctx);
        }
        fn answers(&mut self) -> Vec<(u64, Status, String)> {
            self.services
                .take_completions()
                .into_iter()
                .map(|c| (c.token, c.status, String::from_utf8(c.payload).unwrap()))
                .collect()
        }
        fn replies(&mut self) -> Vec<(u64, String)> {
            self.services
                .take_completions()
                .into_iter()
                .map(|c| (c.token, String::from_utf8(c.payload).unwrap()))
                .collect()
        }
        fn trace(&self) -> Vec<String> {
            std::mem::take(&mut *self.log.borrow_mut())
        }
    }

    #[test]
    fn persist_stashes_new_commands_until_handlers_ran() {
        let mut h = Harness::new();
        let a = h.send("s:e1,s:e2");
        let b = h.send("s:e3");
        let c = h.send("r");
        // Only A's command handler ran; B and C wait; nothing answered.
        assert_eq!(h.trace(), vec!["cmd s:e1,s:e2"]);
        assert_eq!(h.host.stashed(), 2);
        assert!(h.replies().is_empty());
        h.make_durable(1);
        assert_eq!(h.trace(), vec!["evt e1"]);
        assert!(h.replies().is_empty(), "A has an event not yet durable");
        h.make_durable(2);
        // A's handlers done -> reply; then B handled (persists e3, LSN 3),
        // C stays stashed behind it.
        assert_eq!(h.trace(), vec!["evt e2", "cmd s:e3"]);
        assert_eq!(h.replies(), vec![(a, "done e2".to_string())]);
        assert_eq!(h.host.stashed(), 1);
        h.make_durable(3);
        assert_eq!(h.trace(), vec!["evt e3", "cmd r"]);
        assert_eq!(
            h.replies(),
            vec![(b, "done e3".to_string()), (c, "r r".to_string())]
        );
        assert_eq!(h.host.sequence_nr(), 3);
    }

    #[test]
    fn an_idle_entity_keeps_no_pending_work_state() {
        let mut h = Harness::new();
        assert!(h.host.busy.is_none(), "recovered, nothing pending");
        // A command without events allocates nothing for pending work.
        let a = h.send("r");
        assert!(h.host.busy.is_none());
        let b = h.send("s:e1,s:e2");
        let c = h.send("r");
        assert!(h.host.busy.is_some(), "events in flight, C stashed");
        h.make_durable(2);
        assert_eq!(
            h.replies(),
            vec![
                (a, "r r".to_string()),
                (b, "done e2".to_string()),
                (c, "r r".to_string())
            ]
        );
        assert!(h.host.busy.is_none(), "done: freed");
        // The state's host is a few words over the state.
        let size = std::mem::size_of::<Persistent<Recorder>>();
        assert!(size <= 48, "{size} bytes");
    }

    #[test]
    fn appends_durable_at_once_run_their_handlers_and_answer_in_the_same_call() {
        let mem = MemLog {
            durable_on_append: true,
            ..MemLog::default()
        };
        let mut h = Harness::with_log(mem);
        h.host.snapshot_every = 3;
        let ask = |h: &mut Harness, cmd: &str| {
            let mut ctx = EntityContext::new(&h.id, &mut h.services)
                .with_type("rec", 1)
                .with_reply_token(7);
            h.host.handle(&mut ctx, cmd.as_bytes()).unwrap();
            assert!(!ctx.reply_deferred(), "answered in the call");
            let reply = ctx.take_reply().map(|r| String::from_utf8(r).unwrap());
            assert!(h.host.busy.is_none(), "nothing queued for {cmd}");
            reply
        };
        assert_eq!(ask(&mut h, "r").as_deref(), Some("r r"));
        // Two events: both handlers ran in order; the last reply wins.
        assert_eq!(ask(&mut h, "s:e1,a:e2").as_deref(), Some("done e2"));
        assert_eq!(
            h.trace(),
            vec!["cmd r", "cmd s:e1,a:e2", "evt e1", "evt e2"]
        );
        assert_eq!(h.host.sequence_nr(), 2);
        assert!(h.host.pid.is_some(), "the id is kept once it has events");
        // The third event is a snapshot's turn (every 3).
        assert_eq!(ask(&mut h, "s:e3").as_deref(), Some("done e3"));
        assert_eq!(h.host.since_snapshot, 0, "snapshot saved");
        assert!(h.answers().is_empty(), "no deferred completions");
        // The journal holds the events in order.
        let mut ctx = EntityContext::new(&h.id, &mut h.services).with_type("rec", 1);
        let pid = persistence_id(&mut ctx).unwrap();
        let rec = ctx
            .journal()
            .unwrap()
            .recover(&pid, WriterEpoch(1))
            .unwrap();
        assert_eq!(rec.snapshot.map(|s| s.0), Some(3));
    }

    #[test]
    fn persist_async_does_not_stash_and_keeps_handler_order() {
        let mut h = Harness::new();
        let a = h.send("a:x1");
        let b = h.send("a:x2,a:x3");
        let c = h.send("r");
        // Every command handler ran at once; C (no events) answered now.
        assert_eq!(h.trace(), vec!["cmd a:x1", "cmd a:x2,a:x3", "cmd r"]);
        assert_eq!(h.replies(), vec![(c, "r r".to_string())]);
        h.make_durable(3);
        assert_eq!(h.trace(), vec!["evt x1", "evt x2", "evt x3"]);
        assert_eq!(
            h.replies(),
            vec![(a, "done x1".to_string()), (b, "done x3".to_string())]
        );
    }

    #[test]
    fn mixing_async_then_persist_keeps_order() {
        let mut h = Harness::new();
        let _a = h.send("a:x1");
        let _b = h.send("s:y1");
        let _c = h.send("a:x2");
        // C is stashed behind B's persist.
        assert_eq!(h.trace(), vec!["cmd a:x1", "cmd s:y1"]);
        h.make_durable(2);
        assert_eq!(h.trace(), vec!["evt x1", "evt y1", "cmd a:x2"]);
        h.make_durable(3);
        assert_eq!(h.trace(), vec!["evt x2"]);
        assert_eq!(h.replies().len(), 3);
    }

    #[test]
    fn a_stopping_entity_is_kept_until_its_events_are_durable_and_answers_them() {
        let mut h = Harness::new();
        let a = h.send("s:e1");
        let b = h.send("s:e2");
        assert!(h.replies().is_empty());
        // Stop requested with e1 in flight and B stashed: kept, nothing
        // answered yet, nothing failed.
        assert!(h.host.on_stopping());
        assert!(h.replies().is_empty());
        // e1 durable: A answered, the stashed B runs (e2 appended): still
        // kept.
        h.make_durable(1);
        assert_eq!(h.replies(), vec![(a, "done e1".to_string())]);
        assert!(h.host.on_stopping());
        h.make_durable(2);
        assert_eq!(h.replies(), vec![(b, "done e2".to_string())]);
        // Nothing in flight: it may stop; `on_stop` answers nothing more.
        assert!(!h.host.on_stopping());
        h.stop();
        assert!(h.replies().is_empty());
        // `on_stop` without `on_stopping` (a failed incarnation) waits for
        // nothing: its command in flight fails.
        let c = h.send("s:e3");
        h.stop();
        assert_eq!(h.replies(), vec![(c, "entity stopped".to_string())]);
    }

    #[test]
    fn a_hand_off_during_a_recovery_read_runs_the_stashed_commands_before_the_stop() {
        let (mut h, read_done) = Harness::reading();
        // Recovery in flight: the commands are stashed behind it.
        let a = h.send("s:e1");
        let b = h.send("r");
        assert_eq!(h.host.stashed(), 2);
        // The stop (a hand-off) keeps the incarnation while the read is in
        // flight with commands stashed; nothing is answered yet.
        assert!(h.host.on_stopping());
        assert!(h.answers().is_empty());
        h.make_durable(0);
        assert!(h.host.on_stopping(), "the read is still in flight");
        assert!(h.trace().is_empty());
        // The read completes: the stashed commands run in order on the
        // recovered state; A's event is appended (in flight), B waits
        // behind A's persist.
        read_done.set(true);
        h.make_durable(0);
        assert_eq!(h.trace(), vec!["cmd s:e1"]);
        assert!(h.host.on_stopping(), "A's event is in flight");
        h.make_durable(1);
        assert_eq!(h.trace(), vec!["evt e1", "cmd r"]);
        assert_eq!(
            h.answers(),
            vec![
                (a, Status::Ok, "done e1".to_string()),
                (b, Status::Ok, "r r".to_string())
            ]
        );
        assert!(!h.host.on_stopping(), "nothing left: it may stop");
        h.stop();
        assert!(h.answers().is_empty());
    }

    #[test]
    fn a_stop_during_a_recovery_read_answers_the_stashed_commands_safe_to_retry() {
        let (mut h, _read_done) = Harness::reading();
        // Nothing stashed: the read does not keep the incarnation.
        assert!(!h.host.on_stopping());
        let a = h.send("s:e1");
        // A forced stop (the node's drain ended) while the read is in
        // flight: the stashed command was never handled.
        h.stop();
        let got = h.answers();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].0, got[0].1), (a, Status::Unavailable));
        assert!(Status::Unavailable.not_delivered(), "{got:?}");
    }
}
