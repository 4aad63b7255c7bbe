//! Typed protocols on top of the byte API (Akka Typed's `EntityTypeKey[T]`
//! and `EntityRef[T]`).
//!
//! A [`Protocol`] names an entity type's command and reply types and the
//! [`Codec`] that turns them into the bytes the engine routes: the wire
//! stays bytes, so the native client, the HTTP front and other languages
//! talk to a typed entity by sending the codec's bytes ([`Json`] for
//! readable ones, [`Postcard`] for compact ones).
//!
//! ```text
//! let key = EntityTypeKey::<Bank>::new("account")?;  // Bank: the Protocol
//! node.sharding().start_persistent(&key, |_| Account, 100, EntitySettings::default())?;
//! let r = node.typed_ref(&key, "alice")?;            // typed::EntityRef<Bank>
//! let balance = r.ask(Command::Deposit(5)).await?;   // any executor
//! let balance = r.ask_blocking(Command::Balance, timeout)?;
//! ```
//!
//! Handlers: [`Entity`] (state in memory, [`Context::ask`] to other
//! entities with the answer mapped to one of its own commands, as Akka's
//! `context.ask`) and [`PersistentEntity`] (event-sourced: typed events
//! and state, a snapshot codec of the user's choice).
//!
//! Cancel safety of [`AskFuture`]: as [`crate::api`]: the command is sent
//! when `ask` is called; a dropped future does not recall it (it is still
//! handled, at most once) and its reply is discarded.

mod persistent;

pub use persistent::{Effect, PersistentEntity};

use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use shardline_core::ids::{EntityId, IdError, TypeName};
use thiserror::Error;

use crate::api::{NotSent, RawAnswer, RawAskFuture};
use crate::entity::{AskId, EntityAskError, EntityContext, EntityError};
use crate::envelope::Status;
use crate::node::{EntitySettings, NodeError, RegionHandle, Sharding};

/// A value could not be encoded or decoded by a [`Codec`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("codec: {0}")]
pub struct CodecError(pub String);

/// How a protocol's values become bytes and back.
pub trait Codec: 'static {
    /// Encodes `value`.
    ///
    /// # Errors
    /// [`CodecError`] when the value cannot be represented.
    fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError>;

    /// Decodes a value; never allocates more than the input's length
    /// allows (both codecs here read lengths against the remaining input).
    ///
    /// # Errors
    /// [`CodecError`] for bytes that are not a `T`.
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError>;
}

/// [postcard](https://docs.rs/postcard): compact, varint-encoded, not
/// self-describing (both sides need the same types).
#[derive(Debug, Clone, Copy, Default)]
pub struct Postcard;

impl Codec for Postcard {
    fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
        postcard::to_allocvec(value).map_err(|e| CodecError(e.to_string()))
    }
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
        postcard::from_bytes(bytes).map_err(|e| CodecError(e.to_string()))
    }
}

/// JSON (serde_json): readable, what `curl` or another language sends.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json;

impl Codec for Json {
    fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
        serde_json::to_vec(value).map_err(|e| CodecError(e.to_string()))
    }
    fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
        serde_json::from_slice(bytes).map_err(|e| CodecError(e.to_string()))
    }
}

/// An entity type's protocol: what it is sent, what it answers, and how
/// both are encoded on the wire.
pub trait Protocol: 'static {
    /// The messages (commands) the entity handles.
    type Command: Serialize + DeserializeOwned + Send + 'static;
    /// Its reply to a command (carry business refusals here, e.g. a
    /// `Result`; an entity failure is [`AskError::Failed`]).
    type Reply: Serialize + DeserializeOwned + Send + 'static;
    /// The codec of commands and replies.
    type Codec: Codec;
}

/// The name of an entity type together with its protocol (Akka's
/// `EntityTypeKey[T]`).
pub struct EntityTypeKey<P> {
    name: TypeName,
    _p: PhantomData<fn() -> P>,
}

impl<P> Clone for EntityTypeKey<P> {
    fn clone(&self) -> Self {
        EntityTypeKey {
            name: self.name.clone(),
            _p: PhantomData,
        }
    }
}

impl<P> std::fmt::Debug for EntityTypeKey<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "EntityTypeKey({})", self.name.as_str())
    }
}

impl<P: Protocol> EntityTypeKey<P> {
    /// The key of type `name` (1..=255 bytes; no `|`, no leading `__`, not
    /// `coordinator`: see [`TypeName`]).
    ///
    /// # Errors
    /// [`IdError`] for an invalid type name.
    pub fn new(name: &str) -> Result<Self, IdError> {
        Ok(EntityTypeKey {
            name: TypeName::new(name)?,
            _p: PhantomData,
        })
    }

    /// The type name.
    pub fn name(&self) -> &str {
        self.name.as_str()
    }
}

/// Why a typed ask or tell failed. A command that was not sent is handed
/// back.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AskError<C> {
    /// The command was not sent (nothing reached the engine): here it is.
    /// [`NotSent::TooLarge`] when its encoding is longer than
    /// `requests.max_message_size_bytes`.
    #[error("not sent: {reason}")]
    NotSent {
        /// The command, unchanged.
        command: C,
        /// Why.
        reason: NotSent,
    },
    /// The command could not be encoded (not sent): here it is.
    #[error("not sent: {error}")]
    Encode {
        /// The command, unchanged.
        command: C,
        /// The codec's error.
        error: CodecError,
    },
    /// The request failed with `status` (never [`Status::TimedOut`], which
    /// is [`AskError::TimedOut`]); `payload` is what came with it: for
    /// [`Status::EntityFailed`] the entity's error message (its
    /// [`EntityError`]), for a message not delivered the reason.
    #[error("request failed: {status:?}: {}", String::from_utf8_lossy(payload))]
    Failed {
        /// The status of the answer.
        status: Status,
        /// The answer's payload.
        payload: Vec<u8>,
    },
    /// The reply did not decode as the protocol's reply (the entity runs
    /// another version of the protocol).
    #[error("reply: {0}")]
    Decode(CodecError),
    /// No answer within the wait (the command may have been handled),
    /// whether this node or the node the request was forwarded to gave up
    /// waiting.
    #[error("timed out")]
    TimedOut,
    /// The node stopped after the command was sent.
    #[error("node stopped")]
    Stopped,
}

impl<C> AskError<C> {
    /// The command, when it was not sent.
    pub fn into_command(self) -> Option<C> {
        match self {
            AskError::NotSent { command, .. } | AskError::Encode { command, .. } => Some(command),
            _ => None,
        }
    }
}

/// A typed reference to one entity (Akka's `EntityRef[T]`); cheap to
/// clone, usable from any thread and any executor. Made by
/// [`crate::Node::typed_ref`].
pub struct EntityRef<P: Protocol> {
    raw: crate::EntityRef,
    _p: PhantomData<fn() -> P>,
}

impl<P: Protocol> Clone for EntityRef<P> {
    fn clone(&self) -> Self {
        EntityRef {
            raw: self.raw.clone(),
            _p: PhantomData,
        }
    }
}

impl crate::Node {
    /// A typed reference to entity `entity_id` of the type of `key`
    /// anywhere in the cluster.
    ///
    /// # Errors
    /// [`IdError`] for an invalid entity id.
    pub fn typed_ref<P: Protocol>(
        &self,
        key: &EntityTypeKey<P>,
        entity_id: &str,
    ) -> Result<EntityRef<P>, IdError> {
        Ok(EntityRef {
            raw: self.entity_ref(key.name(), entity_id)?,
            _p: PhantomData,
        })
    }
}

impl<P: Protocol> EntityRef<P> {
    /// The entity's id.
    pub fn id(&self) -> &EntityId {
        self.raw.id()
    }

    /// The byte-level reference underneath.
    pub fn raw(&self) -> &crate::EntityRef {
        &self.raw
    }

    /// Asks with the node's `requests.ask_timeout_ms` as timeout (see
    /// [`Self::ask_within`]).
    pub fn ask(&self, command: P::Command) -> AskFuture<P> {
        self.ask_within(command, self.raw.default_timeout())
    }

    /// Sends `command` now and returns the future of the reply, which
    /// resolves on any executor (the data core completes it). Deadline and
    /// wait as [`crate::EntityRef::ask`]: a command still buffered at its
    /// deadline (`timeout`, at most `requests.ask_timeout_ms`) is answered
    /// [`AskError::Failed`] with [`Status::Unavailable`]; with no answer by
    /// the wait (`timeout`, at least 1 s past the deadline) the future
    /// resolves to [`AskError::TimedOut`]; so does a request forwarded to
    /// another node whose reply that node gave up on (its forwarded-reply
    /// wait, the deadline plus 500 ms), which can come sooner.
    ///
    /// A command whose encoding is longer than
    /// `requests.max_message_size_bytes` is not sent, wherever the entity
    /// lives: [`AskError::NotSent`] with [`NotSent::TooLarge`] and the
    /// command.
    ///
    /// Cancel safety: dropping the future does not recall the command (it
    /// is handled at most once) and discards the reply.
    pub fn ask_within(&self, command: P::Command, timeout: Duration) -> AskFuture<P> {
        let state = match P::Codec::encode(&command) {
            Err(error) => State::Done(Some(AskError::Encode { command, error })),
            Ok(bytes) => match self.raw.send_ask(bytes, timeout) {
                Ok(rx) => State::Waiting(RawAskFuture::new(rx)),
                Err(e) => State::Done(Some(AskError::NotSent {
                    command,
                    reason: e.reason,
                })),
            },
        };
        AskFuture {
            state,
            wait: self.raw.wait_of(timeout),
        }
    }

    /// Asks and blocks the calling thread for the reply (for plain
    /// threads; in async code use [`Self::ask`]).
    ///
    /// # Errors
    /// As [`AskFuture`].
    pub fn ask_blocking(
        &self,
        command: P::Command,
        timeout: Duration,
    ) -> Result<P::Reply, AskError<P::Command>> {
        self.ask_within(command, timeout).wait()
    }

    /// Sends `command` without waiting for a reply (at most once; deadline
    /// as [`crate::EntityRef::tell`]). A command whose encoding is longer
    /// than `requests.max_message_size_bytes` is not sent, wherever the
    /// entity lives.
    ///
    /// # Errors
    /// [`AskError::Encode`] or [`AskError::NotSent`] (inbox full, node
    /// stopped, [`NotSent::TooLarge`]), with the command.
    pub fn tell(&self, command: P::Command) -> Result<(), AskError<P::Command>> {
        let bytes = match P::Codec::encode(&command) {
            Ok(b) => b,
            Err(error) => return Err(AskError::Encode { command, error }),
        };
        self.raw.try_tell(bytes).map_err(|e| AskError::NotSent {
            command,
            reason: e.reason,
        })
    }
}

enum State<C> {
    Done(Option<AskError<C>>),
    Waiting(RawAskFuture),
}

/// The future of a typed reply ([`EntityRef::ask`]): `Ok(reply)` or an
/// [`AskError`]. Completed from the data core's thread; any executor.
#[must_use = "the reply is only read by awaiting the future (the command is sent already)"]
pub struct AskFuture<P: Protocol> {
    state: State<P::Command>,
    wait: Duration,
}

// Never pinned structurally: the receiver inside is `Unpin`.
impl<P: Protocol> Unpin for AskFuture<P> {}

fn typed_answer<P: Protocol>(a: RawAnswer) -> Result<P::Reply, AskError<P::Command>> {
    match a {
        RawAnswer::Reply(bytes) => P::Codec::decode(&bytes).map_err(AskError::Decode),
        // A timeout is one variant wherever it was decided (here, or by
        // the node the request was forwarded to).
        RawAnswer::Failed(Status::TimedOut, _) => Err(AskError::TimedOut),
        RawAnswer::Failed(status, payload) => Err(AskError::Failed { status, payload }),
        RawAnswer::TimedOut => Err(AskError::TimedOut),
        RawAnswer::Stopped => Err(AskError::Stopped),
    }
}

impl<P: Protocol> AskFuture<P> {
    /// Blocks the calling thread until the answer.
    ///
    /// # Errors
    /// As the future.
    pub fn wait(self) -> Result<P::Reply, AskError<P::Command>> {
        match self.state {
            State::Done(e) => Err(e.unwrap_or(AskError::Stopped)),
            State::Waiting(rx) => typed_answer::<P>(rx.wait(self.wait)),
        }
    }
}

impl<P: Protocol> Future for AskFuture<P> {
    type Output = Result<P::Reply, AskError<P::Command>>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        match &mut this.state {
            State::Done(e) => Poll::Ready(Err(e.take().unwrap_or(AskError::Stopped))),
            State::Waiting(rx) => match Pin::new(rx).poll(cx) {
                Poll::Pending => Poll::Pending,
                Poll::Ready(a) => Poll::Ready(typed_answer::<P>(a)),
            },
        }
    }
}

/// Why an ask between entities ([`Context::ask`]) has no reply.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum EntityAskFailure {
    /// The request failed: status and payload ([`AskError::Failed`]).
    #[error("ask failed: {status:?}: {}", String::from_utf8_lossy(payload))]
    Failed {
        /// The status of the answer.
        status: Status,
        /// The answer's payload.
        payload: Vec<u8>,
    },
    /// No answer within the ask's timeout.
    #[error("ask timed out")]
    TimedOut,
    /// The reply did not decode as the target protocol's reply.
    #[error("reply: {0}")]
    Decode(CodecError),
}

type Adapter<C> = Box<dyn FnOnce(Result<Vec<u8>, EntityAskError>) -> C>;

/// What a typed handler may ask of the runtime: its id, passivation,
/// timers, and typed tells and asks to other entities.
pub struct Context<'c, 'a, P: Protocol> {
    raw: &'c mut EntityContext<'a>,
    asks: &'c mut HashMap<u64, Adapter<P::Command>>,
}

impl<'a, P: Protocol> Context<'_, 'a, P> {
    /// This entity's id.
    pub fn self_id(&self) -> &EntityId {
        self.raw.self_id()
    }

    /// Asks to be stopped after this message (Akka's `Passivate`).
    pub fn passivate(&mut self) {
        self.raw.passivate();
    }

    /// Starts (or restarts) timer `key`: after `delay`, [`Entity::on_timer`].
    pub fn set_timer(&mut self, key: u64, delay: Duration) {
        self.raw.set_timer(key, delay);
    }

    /// Cancels timer `key`.
    pub fn cancel_timer(&mut self, key: u64) {
        self.raw.cancel_timer(key);
    }

    /// The byte-level context (watches, forwards, raw tells).
    pub fn raw(&mut self) -> &mut EntityContext<'a> {
        self.raw
    }

    /// Sends `command` to entity `id` of the type of `key` without waiting
    /// (at most once; see [`EntityContext::tell`]).
    ///
    /// # Errors
    /// [`CodecError`] when the command does not encode (nothing sent).
    pub fn tell<Q: Protocol>(
        &mut self,
        key: &EntityTypeKey<Q>,
        id: &EntityId,
        command: &Q::Command,
    ) -> Result<(), CodecError> {
        let bytes = Q::Codec::encode(command)?;
        self.raw.tell(key.name(), id, bytes);
        Ok(())
    }

    /// Asks entity `id` of the type of `key` (Akka's `context.ask`): the
    /// reply, or why there is none ([`EntityAskFailure`], `TimedOut` after
    /// `timeout`), is turned by `adapt` into one of this entity's own
    /// commands, which [`Entity::handle`] then handles like any message
    /// (its reply goes nowhere). Exactly one such command per ask while
    /// this incarnation lives; none if it stops first. Works across cores
    /// and nodes. Only sharded entities ask: in a stateless worker the ask
    /// is dropped (logged) and `adapt` is kept, never called, until the
    /// activation stops.
    ///
    /// # Errors
    /// [`CodecError`] when the command does not encode (nothing sent).
    pub fn ask<Q: Protocol>(
        &mut self,
        key: &EntityTypeKey<Q>,
        id: &EntityId,
        command: &Q::Command,
        timeout: Duration,
        adapt: impl FnOnce(Result<Q::Reply, EntityAskFailure>) -> P::Command + 'static,
    ) -> Result<AskId, CodecError> {
        let bytes = Q::Codec::encode(command)?;
        let ask = self.raw.ask(key.name(), id, bytes, timeout);
        let adapter: Adapter<P::Command> = Box::new(move |r| {
            adapt(match r {
                Ok(bytes) => Q::Codec::decode(&bytes).map_err(EntityAskFailure::Decode),
                Err(EntityAskError::Failed {
                    status: Status::TimedOut,
                    ..
                }) => Err(EntityAskFailure::TimedOut),
                Err(EntityAskError::Failed { status, payload }) => {
                    Err(EntityAskFailure::Failed { status, payload })
                }
                Err(_) => Err(EntityAskFailure::TimedOut),
            })
        });
        self.asks.insert(ask.0, adapter);
        Ok(ask)
    }
}

/// A typed entity: state in memory, one handler for its protocol's
/// commands. Runs on its data core, never concurrently.
pub trait Entity: 'static {
    /// The protocol it speaks.
    type Protocol: Protocol;

    /// Called once when the incarnation starts, before its first command.
    fn on_start(&mut self, _ctx: &mut Context<'_, '_, Self::Protocol>) {}

    /// Handles one command and returns the reply (sent to an asker;
    /// dropped for a tell or a command made by an ask's adapter).
    ///
    /// A message that does not decode as a command is answered
    /// [`Status::EntityFailed`] with the codec's error, and the entity
    /// keeps running.
    ///
    /// # Errors
    /// [`EntityError`]: the asker gets [`AskError::Failed`] with
    /// [`Status::EntityFailed`] and the error's text; the incarnation is
    /// stopped (its state is lost).
    fn handle(
        &mut self,
        ctx: &mut Context<'_, '_, Self::Protocol>,
        command: <Self::Protocol as Protocol>::Command,
    ) -> Result<<Self::Protocol as Protocol>::Reply, EntityError>;

    /// Called when timer `key` fires.
    fn on_timer(&mut self, _ctx: &mut Context<'_, '_, Self::Protocol>, _key: u64) {}

    /// Called once when the incarnation stops.
    fn on_stop(&mut self) {}
}

/// Hosts a typed [`Entity`] as a byte-level one.
struct Host<E: Entity> {
    entity: E,
    asks: HashMap<u64, Adapter<<E::Protocol as Protocol>::Command>>,
}

/// The `EntityFailed` answer to a message that does not decode as a
/// command of the entity's protocol (`error`: the codec's), the same for
/// [`Entity`] and [`PersistentEntity`]; the entity keeps running.
pub(crate) fn undecodable_command(error: &CodecError) -> Vec<u8> {
    format!("not a command of this type: {error}").into_bytes()
}

/// Answers the current message with `status` and `payload` and keeps the
/// entity running.
fn answer_failed(ctx: &mut EntityContext<'_>, status: Status, payload: Vec<u8>) {
    if let Some(token) = ctx.defer_reply() {
        ctx.complete(token, status, payload);
    }
}

impl<E: Entity> Host<E> {
    fn run(
        &mut self,
        raw: &mut EntityContext<'_>,
        command: <E::Protocol as Protocol>::Command,
    ) -> Result<(), EntityError> {
        let mut ctx = Context {
            raw,
            asks: &mut self.asks,
        };
        let reply = self.entity.handle(&mut ctx, command)?;
        match <E::Protocol as Protocol>::Codec::encode(&reply) {
            Ok(bytes) => raw.reply(bytes),
            Err(e) => answer_failed(raw, Status::EntityFailed, e.to_string().into_bytes()),
        }
        Ok(())
    }
}

impl<E: Entity> crate::entity::Entity for Host<E> {
    fn on_start(&mut self, raw: &mut EntityContext<'_>) {
        let mut ctx = Context {
            raw,
            asks: &mut self.asks,
        };
        self.entity.on_start(&mut ctx);
    }

    fn handle(&mut self, raw: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        match <E::Protocol as Protocol>::Codec::decode(message) {
            Ok(command) => self.run(raw, command),
            Err(e) => {
                answer_failed(raw, Status::EntityFailed, undecodable_command(&e));
                Ok(())
            }
        }
    }

    fn on_timer(&mut self, raw: &mut EntityContext<'_>, key: u64) {
        let mut ctx = Context {
            raw,
            asks: &mut self.asks,
        };
        self.entity.on_timer(&mut ctx, key);
    }

    fn on_ask_reply(
        &mut self,
        raw: &mut EntityContext<'_>,
        ask: AskId,
        reply: Result<Vec<u8>, EntityAskError>,
    ) -> Result<(), EntityError> {
        let Some(adapt) = self.asks.remove(&ask.0) else {
            return Ok(());
        };
        let command = adapt(reply);
        self.run(raw, command)
    }

    fn on_stop(&mut self, _ctx: &mut EntityContext<'_>) {
        self.entity.on_stop();
    }
}

impl Sharding<'_> {
    /// Starts the regions of the typed entity type of `key` on this node
    /// (as [`Sharding::start`]); `factory` makes an entity for an id.
    ///
    /// Every entity runs under a supervisor with the default
    /// [`crate::entity::supervision::SupervisorSettings`]: a handler that
    /// panics or returns an error fails its message (`EntityFailed`) and the
    /// entity is restarted from `factory` after a backoff (100 ms doubling
    /// to 10 s); more than 10 failures in 60 s stop it. The data core and
    /// the other entities keep serving.
    ///
    /// # Errors
    /// As [`Sharding::start`].
    pub fn start_typed<E: Entity>(
        &self,
        key: &EntityTypeKey<E::Protocol>,
        factory: impl Fn(&EntityId) -> E + Send + Sync + 'static,
        settings: EntitySettings,
    ) -> Result<RegionHandle, NodeError> {
        let factory = Arc::new(factory);
        self.start(
            key.name(),
            crate::entity::supervision::supervised(
                Arc::new(move |id| {
                    Box::new(Host {
                        entity: factory(id),
                        asks: HashMap::new(),
                    })
                }),
                crate::entity::supervision::SupervisorSettings::default(),
            ),
            settings,
        )
    }
}
