//! The entity API: user actors hosted by the regions.
//!
//! An [`Entity`] lives on exactly one data core (the home of its shard). Its
//! handler runs on that core's executor, one message at a time, to
//! completion (it must not block). It answers through the
//! [`EntityContext`]: [`EntityContext::reply`], [`EntityContext::passivate`]
//! (ask to be stopped), timers, and its own id.
//!
//! Built in: [`Echo`] and [`Counter`] (payloads in `notes/INTERFACES.md`).

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

/// What a handler may ask of the runtime.
pub struct EntityContext<'a> {
    id: &'a EntityId,
    reply: Option<Vec<u8>>,
    passivate: bool,
    timers: Vec<(u64, Option<Duration>)>,
}

impl<'a> EntityContext<'a> {
    /// A context for entity `id` (used by the runtime and by unit tests of
    /// entities).
    pub fn new(id: &'a EntityId) -> Self {
        EntityContext {
            id,
            reply: None,
            passivate: false,
            timers: Vec::new(),
        }
    }

    /// This entity's id.
    pub fn self_id(&self) -> &EntityId {
        self.id
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

    /// Takes the reply set by the handler.
    pub fn take_reply(&mut self) -> Option<Vec<u8>> {
        self.reply.take()
    }

    /// Whether the handler asked to be passivated.
    pub fn wants_passivation(&self) -> bool {
        self.passivate
    }

    /// Takes the timer commands (`(key, Some(delay))` set, `(key, None)` cancel).
    pub fn take_timers(&mut self) -> Vec<(u64, Option<Duration>)> {
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
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError>;

    /// Called when timer `key` fires.
    fn on_timer(&mut self, _ctx: &mut EntityContext<'_>, _key: u64) {}

    /// Called once when the incarnation stops (passivation, hand-off, leave).
    fn on_stop(&mut self) {}
}

/// Creates an entity for an id; shared by every data core of a node.
pub type EntityFactory = Arc<dyn Fn(&EntityId) -> Box<dyn Entity> + Send + Sync>;

/// Replies with the payload unchanged.
#[derive(Debug, Default)]
pub struct Echo;

impl Entity for Echo {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        ctx.reply(message);
        Ok(())
    }
}

/// An i64 counter: `add <n>` replies with the new value, `get` with the
/// current one (ASCII decimal). An unparsable command is answered with
/// `error: <reason>` and leaves the value as it was.
#[derive(Debug, Default)]
pub struct Counter {
    value: i64,
}

impl Entity for Counter {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        let reply = match std::str::from_utf8(message) {
            Err(_) => "error: command is not UTF-8".to_string(),
            Ok("get") => self.value.to_string(),
            Ok(cmd) => match cmd.strip_prefix("add ") {
                None => format!("error: unknown command `{}`", cmd.escape_debug()),
                Some(n) => match n.trim().parse::<i64>() {
                    Err(e) => format!("error: bad number: {e}"),
                    Ok(n) => match self.value.checked_add(n) {
                        None => "error: overflow".to_string(),
                        Some(v) => {
                            self.value = v;
                            v.to_string()
                        }
                    },
                },
            },
        };
        ctx.reply(reply);
        Ok(())
    }
}

/// The factory of a built-in kind.
pub fn builtin_factory(kind: crate::config::EntityKind) -> EntityFactory {
    match kind {
        crate::config::EntityKind::Echo => Arc::new(|_| Box::new(Echo)),
        crate::config::EntityKind::Counter => Arc::new(|_| Box::<Counter>::default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(e: &mut dyn Entity, msg: &str) -> String {
        let id = EntityId::new("x").unwrap();
        let mut ctx = EntityContext::new(&id);
        e.handle(&mut ctx, msg.as_bytes()).unwrap();
        String::from_utf8(ctx.take_reply().unwrap()).unwrap()
    }

    #[test]
    fn counter_commands() {
        let mut c = Counter::default();
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
