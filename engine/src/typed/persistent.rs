//! Typed event-sourced entities on top of
//! [`crate::entity::persistent::PersistentEntity`] (Akka Typed's
//! `EventSourcedBehavior`): a command handler that returns an [`Effect`]
//! (persist typed events, then reply from the new state), an event handler
//! that applies an event to the state, and the state as the snapshot,
//! encoded with a codec of the user's choice.

use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;
use shardline_core::ids::EntityId;

use super::{Codec, EntityTypeKey, Protocol};
use crate::entity::persistent::{PersistContext, Persistent};
use crate::entity::EntityError;
use crate::node::{EntitySettings, NodeError, RegionHandle, Sharding};

/// A typed event-sourced entity. Persistence id `{type}|{id}`; semantics
/// of [`crate::entity::persistent`] (events durable before their
/// handler runs and before the reply goes out; commands stashed while a
/// command's events are pending; recovery from the latest snapshot and the
/// events after it).
pub trait PersistentEntity: 'static {
    /// The protocol it speaks.
    type Protocol: Protocol;
    /// Its events (encoded with [`Self::EventCodec`] in the journal).
    type Event: Serialize + DeserializeOwned + 'static;
    /// Its state; `Default` is the state of an entity with no events.
    /// `Clone`: the reply to a persisting command is computed on a copy of
    /// the state with the command's events applied, when they are decided
    /// (it is sent only once they are durable).
    type State: Serialize + DeserializeOwned + Clone + Default + 'static;
    /// The codec of events in the journal.
    type EventCodec: Codec;
    /// The codec of snapshots (the state).
    type SnapshotCodec: Codec;

    /// Decides what a command does given the current state.
    fn on_command(
        &self,
        state: &Self::State,
        command: <Self::Protocol as Protocol>::Command,
    ) -> Effect<Self>;

    /// Applies one event to the state (after it is durable, and during
    /// recovery). Must not fail: an event that was persisted happened.
    fn apply(&self, state: &mut Self::State, event: &Self::Event);
}

type ReplyFn<E> = Box<
    dyn FnOnce(
        &<E as PersistentEntity>::State,
    ) -> <<E as PersistentEntity>::Protocol as Protocol>::Reply,
>;

/// What a command does: persist events (possibly none), then reply from
/// the state they lead to; optionally passivate.
pub struct Effect<E: PersistentEntity + ?Sized> {
    events: Vec<E::Event>,
    reply: Option<ReplyFn<E>>,
    passivate: bool,
}

impl<E: PersistentEntity + ?Sized> Effect<E> {
    /// Persist `events` atomically in order (new commands wait until they
    /// are applied); reply with [`Self::then_reply`]. Without
    /// `then_reply` the command's answer is `Ok` with an empty payload once
    /// the events are durable, which a typed asker sees as
    /// [`super::AskError::Decode`] unless the protocol's reply decodes from
    /// no bytes (e.g. `()` with postcard): use it for `tell`s.
    pub fn persist(events: impl IntoIterator<Item = E::Event>) -> Self {
        Effect {
            events: events.into_iter().collect(),
            reply: None,
            passivate: false,
        }
    }

    /// Persist nothing and reply with `reply`.
    pub fn reply(reply: <E::Protocol as Protocol>::Reply) -> Self {
        Effect {
            events: Vec::new(),
            reply: Some(Box::new(move |_| reply)),
            passivate: false,
        }
    }

    /// The reply, computed from the state after the events (sent once they
    /// are durable).
    pub fn then_reply(
        mut self,
        reply: impl FnOnce(&E::State) -> <E::Protocol as Protocol>::Reply + 'static,
    ) -> Self {
        self.reply = Some(Box::new(reply));
        self
    }

    /// Passivate the entity after this command.
    pub fn and_passivate(mut self) -> Self {
        self.passivate = true;
        self
    }
}

/// Hosts a typed [`PersistentEntity`] as a byte-level one.
struct Host<E: PersistentEntity> {
    entity: E,
    state: E::State,
}

impl<E: PersistentEntity> crate::entity::persistent::PersistentEntity for Host<E> {
    fn on_command(&mut self, ctx: &mut PersistContext, command: &[u8]) -> Result<(), EntityError> {
        let command = match <E::Protocol as Protocol>::Codec::decode(command) {
            Ok(c) => c,
            Err(e) => {
                // Not a command at all: answered as the in-memory typed
                // entity answers it; the incarnation keeps serving.
                ctx.refuse(super::undecodable_command(&e));
                return Ok(());
            }
        };
        let effect = self.entity.on_command(&self.state, command);
        if effect.passivate {
            ctx.passivate();
        }
        let mut events = Vec::with_capacity(effect.events.len());
        for ev in &effect.events {
            events.push(
                E::EventCodec::encode(ev)
                    .map_err(|e| EntityError::Failed(format!("event: {e}")))?,
            );
        }
        if let Some(reply) = effect.reply {
            let value = if effect.events.is_empty() {
                reply(&self.state)
            } else {
                let mut next = self.state.clone();
                for ev in &effect.events {
                    self.entity.apply(&mut next, ev);
                }
                reply(&next)
            };
            let bytes = <E::Protocol as Protocol>::Codec::encode(&value)
                .map_err(|e| EntityError::Failed(format!("reply: {e}")))?;
            ctx.reply(bytes);
        }
        ctx.persist_all(events);
        Ok(())
    }

    fn on_event(&mut self, _ctx: &mut PersistContext, event: &[u8]) -> Result<(), EntityError> {
        let ev: E::Event = E::EventCodec::decode(event)
            .map_err(|e| EntityError::Failed(format!("event in the journal: {e}")))?;
        self.entity.apply(&mut self.state, &ev);
        Ok(())
    }

    fn snapshot(&self) -> Vec<u8> {
        match E::SnapshotCodec::encode(&self.state) {
            Ok(b) => b,
            Err(e) => {
                // An empty snapshot fails to restore: recovery then fails
                // loudly rather than resuming from a wrong state.
                tracing::error!(error = %e, "snapshot does not encode");
                Vec::new()
            }
        }
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), EntityError> {
        self.state = E::SnapshotCodec::decode(snapshot)
            .map_err(|e| EntityError::Failed(format!("snapshot: {e}")))?;
        Ok(())
    }
}

impl Sharding<'_> {
    /// Starts the regions of the typed event-sourced type of `key` on this
    /// node; `factory` makes the entity (its behaviour; the state starts
    /// at `State::default()` and is recovered from the journal). A
    /// snapshot every `snapshot_every` events (0: never).
    ///
    /// A message that does not decode as a command is answered
    /// [`crate::envelope::Status::EntityFailed`] with the codec's error
    /// (`not a command of this type: ...`), as [`Sharding::start_typed`]'s
    /// entities answer it: nothing is appended and the entity keeps
    /// running (no restart, no count toward the supervisor's limit). An
    /// event that does not encode or a reply that does not encode fails
    /// the command ([`super::AskError::Failed`] with `EntityFailed`) and
    /// restarts the incarnation from the journal. The entity runs under a supervisor
    /// with the default settings, as [`Sharding::start_typed`]'s: a
    /// handler that panics fails its command and the entity is restarted
    /// from the journal after the backoff.
    ///
    /// # Errors
    /// As [`Sharding::start`].
    pub fn start_persistent<E: PersistentEntity>(
        &self,
        key: &EntityTypeKey<E::Protocol>,
        factory: impl Fn(&EntityId) -> E + Send + Sync + 'static,
        snapshot_every: u64,
        settings: EntitySettings,
    ) -> Result<RegionHandle, NodeError> {
        let factory = Arc::new(factory);
        self.start(
            key.name(),
            // The supervisor, the persistent host and the typed host with
            // the entity and its state: one allocation per entity.
            crate::entity::supervision::supervised_inline(
                Arc::new(move |id| {
                    Persistent::new(
                        Host {
                            entity: factory(id),
                            state: E::State::default(),
                        },
                        snapshot_every,
                    )
                }),
                crate::entity::supervision::SupervisorSettings::default(),
            ),
            settings,
        )
    }
}
