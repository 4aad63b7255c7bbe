//! Supervision: an entity whose handler panics or returns an error is
//! restarted with exponential backoff, and stopped after too many restarts.
//!
//! Semantics follow Akka's `BackoffSupervisor`
//! (<https://doc.akka.io/docs/akka/current/general/supervision.html>):
//! the delay before restart `n` (0-based) is
//! `min(max_backoff, min_backoff * 2^n) * (1 + r * random_factor)` with `r`
//! uniform in `[0, 1)`; `n` counts the restarts within the last `window`.
//! The failing message is not redelivered; its sender gets
//! `EntityFailed`; messages that arrive while the entity waits for its
//! restart are answered `EntityFailed` ("restarting") as well. A durable
//! entity recovers its state from the journal on restart (its `on_start`).
//! More than `max_restarts` failures within `window` stop the entity (it
//! passivates; the next message starts a fresh incarnation) and the reason
//! is logged. A panic is caught on the entity's own call
//! (`catch_unwind`), so neither the core, the shard, nor other entities are
//! affected.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use super::{Entity, EntityContext, EntityError, EntityFactory};
use crate::envelope::Status;
use shardline_core::ids::EntityId;

/// The timer key the supervisor reserves for its restarts.
pub const RESTART_TIMER_KEY: u64 = u64::MAX;

/// Backoff and restart limits.
#[derive(Debug, Clone, PartialEq)]
pub struct SupervisorSettings {
    /// First restart delay. Default 100 ms.
    pub min_backoff: Duration,
    /// Largest restart delay. Default 10 s.
    pub max_backoff: Duration,
    /// Random extra delay as a fraction of the delay (0.0..=1.0). Default 0.2.
    pub random_factor: f64,
    /// Most restarts within `window` before the entity is stopped
    /// (count). Default 10.
    pub max_restarts: u32,
    /// The window restarts are counted in. Default 60 s.
    pub window: Duration,
}

impl SupervisorSettings {
    /// The supervisor settings of a configured entity type, from its
    /// `restart_min_backoff_ms`, `restart_max_backoff_ms`,
    /// `restart_random_factor`, `max_restarts` and `restart_window_ms` keys.
    pub fn of_type(t: &crate::config::EntityTypeConfig) -> SupervisorSettings {
        SupervisorSettings {
            min_backoff: Duration::from_millis(t.restart_min_backoff_ms),
            max_backoff: Duration::from_millis(t.restart_max_backoff_ms),
            random_factor: t.restart_random_factor,
            max_restarts: t.max_restarts,
            window: Duration::from_millis(t.restart_window_ms),
        }
    }
}

impl Default for SupervisorSettings {
    fn default() -> Self {
        SupervisorSettings {
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            random_factor: 0.2,
            max_restarts: 10,
            window: Duration::from_secs(60),
        }
    }
}

impl SupervisorSettings {
    /// The delay before restart `n` (0-based) for a random draw `r` in
    /// `[0, 1)`.
    pub fn backoff(&self, n: u32, r: f64) -> Duration {
        let base = self
            .min_backoff
            .saturating_mul(1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX))
            .min(self.max_backoff);
        base.mul_f64(1.0 + r.clamp(0.0, 1.0) * self.random_factor.clamp(0.0, 1.0))
    }
}

/// Wraps every entity `inner` makes in a [`Supervisor`].
pub fn supervised(inner: EntityFactory, settings: SupervisorSettings) -> EntityFactory {
    // An entity factory is the child factory of a boxed child.
    supervised_inline(inner, settings)
}

/// Makes a child of type `C` for an entity id (a [`Supervisor`]'s factory,
/// shared by every entity of the type).
pub type ChildFactory<C> = std::sync::Arc<dyn Fn(&EntityId) -> C + Send + Sync>;

/// Wraps every entity `make` makes in a [`Supervisor`] that holds it
/// inline: one allocation per entity for both, and one pointer less to
/// follow per message, than [`supervised`]'s boxed child (a built-in type
/// knows its child's type; a boxed `dyn Entity` hosts any).
pub fn supervised_inline<C: Entity + 'static>(
    make: ChildFactory<C>,
    settings: SupervisorSettings,
) -> EntityFactory {
    // Shared by every entity of the type (one pointer each, not a copy).
    let shared = std::sync::Arc::new((make, settings));
    std::sync::Arc::new(move |id| {
        Box::new(Supervisor {
            child: Some((shared.0)(id)),
            shared: shared.clone(),
            history: None,
        })
    })
}

fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    t | 1
}

/// One supervised entity: the child incarnation and, once it failed, its
/// failure history and the pending restart.
///
/// The child `C` is held inline: a boxed `dyn Entity` (the default) hosts
/// any child; a built-in type names its own ([`supervised_inline`]).
pub struct Supervisor<C: Entity = Box<dyn Entity>> {
    /// The child's factory and the settings, shared by the type.
    shared: std::sync::Arc<(ChildFactory<C>, SupervisorSettings)>,
    child: Option<C>,
    /// `None` until the first failure: an entity that never failed keeps
    /// one null pointer for it (idle entities are most of a node's).
    history: Option<Box<History>>,
}

/// A supervised entity's failures and restarts.
struct History {
    /// When the failures within the window happened, oldest first.
    failures: VecDeque<Instant>,
    restart_at: Option<Instant>,
    stopped: bool,
    restarts: u64,
    /// The backoff's random state (seeded at the first failure).
    seed: u64,
}

impl History {
    fn new() -> Self {
        History {
            failures: VecDeque::new(),
            restart_at: None,
            stopped: false,
            restarts: 0,
            seed: seed(),
        }
    }

    fn random(&mut self) -> f64 {
        // xorshift64*
        let mut x = self.seed;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.seed = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The message of panic payload `p`, which is then dropped (a panic while
/// dropping it is caught, see [`super::drop_panic_payload`]).
fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    let text = super::panic_text(p.as_ref());
    super::drop_panic_payload(p);
    text
}

impl<C: Entity> Supervisor<C> {
    /// Restarts so far (count).
    pub fn restarts(&self) -> u64 {
        self.history.as_ref().map_or(0, |h| h.restarts)
    }

    fn history(&mut self) -> &mut History {
        self.history.get_or_insert_with(|| Box::new(History::new()))
    }

    fn stopped(&self) -> bool {
        self.history.as_ref().is_some_and(|h| h.stopped)
    }

    fn restart_at(&self) -> Option<Instant> {
        self.history.as_ref().and_then(|h| h.restart_at)
    }

    /// The child failed: drop it, then schedule a restart or stop.
    fn failed(&mut self, ctx: &mut EntityContext<'_>, why: &str) {
        if let Some(mut c) = self.child.take() {
            if super::catch_panic(|| c.on_stop(ctx)).is_err() {
                tracing::warn!(entity = %ctx.self_id(), "on_stop panicked");
            }
        }
        // The failed child's reply and timers (also those its `on_stop`
        // set) are dropped: timers would fire into the restarted child.
        let _ = ctx.take_reply();
        let _ = ctx.take_timers();
        let now = Instant::now();
        let settings = &self.shared.1;
        let h = self.history.get_or_insert_with(|| Box::new(History::new()));
        h.failures.push_back(now);
        while h
            .failures
            .front()
            .is_some_and(|t| now.duration_since(*t) > settings.window)
        {
            h.failures.pop_front();
        }
        let n = h.failures.len() as u32;
        if n > settings.max_restarts {
            tracing::error!(
                entity = %ctx.self_id(),
                failures = n,
                window_ms = settings.window.as_millis() as u64,
                reason = why,
                "entity failed more than max_restarts times within the window; stopping it"
            );
            h.stopped = true;
            ctx.stop_after_failure();
            return;
        }
        let delay = {
            let r = h.random();
            settings.backoff(n.saturating_sub(1), r)
        };
        tracing::warn!(entity = %ctx.self_id(), reason = why, delay_ms = delay.as_millis() as u64, "entity failed; restarting after backoff");
        h.restart_at = Some(now + delay);
        ctx.set_timer(RESTART_TIMER_KEY, delay);
    }

    fn restart(&mut self, ctx: &mut EntityContext<'_>) {
        let h = self.history();
        h.restart_at = None;
        h.restarts += 1;
        let id = ctx.self_id().clone();
        let factory = self.shared.0.clone();
        match catch_unwind(AssertUnwindSafe(|| {
            let mut c = factory(&id);
            c.on_start(ctx);
            c
        })) {
            Ok(c) => self.child = Some(c),
            Err(p) => {
                let why = format!("start panicked: {}", panic_text(p));
                self.failed(ctx, &why);
            }
        }
    }

    fn reject(ctx: &mut EntityContext<'_>, why: &str) {
        if let Some(t) = ctx.defer_reply() {
            ctx.complete(t, Status::EntityFailed, why.as_bytes().to_vec());
        }
    }
}

impl<C: Entity> Entity for Supervisor<C> {
    fn on_start(&mut self, ctx: &mut EntityContext<'_>) {
        let Some(c) = self.child.as_mut() else { return };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| c.on_start(ctx))) {
            let why = format!("start panicked: {}", panic_text(p));
            self.failed(ctx, &why);
        }
    }

    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        if self.stopped() {
            Self::reject(ctx, "entity stopped after too many failures");
            return Ok(());
        }
        if self.child.is_none() {
            if self.restart_at().is_some_and(|t| Instant::now() >= t) {
                self.restart(ctx);
            }
            if self.child.is_none() {
                Self::reject(ctx, "entity is restarting after a failure");
                return Ok(());
            }
        }
        let Some(c) = self.child.as_mut() else {
            return Ok(());
        };
        let why = match catch_unwind(AssertUnwindSafe(|| c.handle(ctx, message))) {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(p) => format!("handler panicked: {}", panic_text(p)),
        };
        Self::reject(ctx, &why);
        self.failed(ctx, &why);
        Ok(())
    }

    fn on_timer(&mut self, ctx: &mut EntityContext<'_>, key: u64) {
        if key == RESTART_TIMER_KEY {
            if self.child.is_none() && !self.stopped() && self.restart_at().is_some() {
                self.restart(ctx);
            }
            return;
        }
        let Some(c) = self.child.as_mut() else { return };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| c.on_timer(ctx, key))) {
            let why = format!("timer panicked: {}", panic_text(p));
            self.failed(ctx, &why);
        }
    }

    fn on_durable(
        &mut self,
        ctx: &mut EntityContext<'_>,
        durable_lsn: u64,
    ) -> Result<(), EntityError> {
        let Some(c) = self.child.as_mut() else {
            return Ok(());
        };
        let why = match catch_unwind(AssertUnwindSafe(|| c.on_durable(ctx, durable_lsn))) {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(p) => format!("event handler panicked: {}", panic_text(p)),
        };
        self.failed(ctx, &why);
        Ok(())
    }

    fn on_terminated(
        &mut self,
        ctx: &mut EntityContext<'_>,
        type_name: &str,
        entity_id: &shardline_core::ids::EntityId,
        reason: super::TerminatedReason,
    ) {
        let Some(c) = self.child.as_mut() else { return };
        if let Err(p) = catch_unwind(AssertUnwindSafe(|| {
            c.on_terminated(ctx, type_name, entity_id, reason)
        })) {
            let why = format!("terminated handler panicked: {}", panic_text(p));
            self.failed(ctx, &why);
        }
    }

    fn on_ask_reply(
        &mut self,
        ctx: &mut EntityContext<'_>,
        ask: super::AskId,
        reply: Result<Vec<u8>, super::EntityAskError>,
    ) -> Result<(), EntityError> {
        // A restarted child did not make the ask: the answer is dropped.
        let Some(c) = self.child.as_mut() else {
            return Ok(());
        };
        let why = match catch_unwind(AssertUnwindSafe(|| c.on_ask_reply(ctx, ask, reply))) {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(p) => format!("ask reply handler panicked: {}", panic_text(p)),
        };
        self.failed(ctx, &why);
        Ok(())
    }

    fn on_stopping(&mut self) -> bool {
        let Some(c) = self.child.as_mut() else {
            return false;
        };
        super::catch_panic(|| c.on_stopping()).unwrap_or(false)
    }

    fn may_stop_waiting(&mut self) -> bool {
        let Some(c) = self.child.as_mut() else {
            return true;
        };
        super::catch_panic(|| c.may_stop_waiting()).unwrap_or(true)
    }

    fn on_stop(&mut self, ctx: &mut EntityContext<'_>) {
        if let Some(mut c) = self.child.take() {
            let _ = super::catch_panic(|| c.on_stop(ctx));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_core::ids::EntityId;
    use std::sync::Arc;

    /// Panics on `boom`, errs on `err`, else replies with its message count.
    struct Fragile {
        n: u64,
    }

    impl Entity for Fragile {
        fn handle(&mut self, ctx: &mut EntityContext<'_>, m: &[u8]) -> Result<(), EntityError> {
            match m {
                b"boom" => panic!("boom requested"),
                b"err" => Err(EntityError::Failed("bad".into())),
                _ => {
                    self.n += 1;
                    ctx.reply(self.n.to_string());
                    Ok(())
                }
            }
        }
    }

    fn settings(max_restarts: u32) -> SupervisorSettings {
        SupervisorSettings {
            min_backoff: Duration::ZERO,
            max_backoff: Duration::ZERO,
            random_factor: 0.0,
            max_restarts,
            window: Duration::from_secs(3600),
        }
    }

    fn send(e: &mut dyn Entity, id: &EntityId, m: &str) -> (Status, String) {
        let mut services = crate::entity::EntityServices::default();
        let mut ctx = EntityContext::new(id, &mut services).with_reply_token(7);
        e.handle(&mut ctx, m.as_bytes()).unwrap();
        if ctx.reply_deferred() {
            drop(ctx);
            let c = services.take_completions().remove(0);
            (c.status, String::from_utf8(c.payload).unwrap())
        } else {
            let p = ctx.take_reply().unwrap_or_default();
            (Status::Ok, String::from_utf8(p).unwrap())
        }
    }

    /// Entity `a` of `f` (a `Fragile` child, zero backoff): a panic and an
    /// error each answer `EntityFailed` and restart a fresh child.
    fn check_restarts_fresh(f: EntityFactory) {
        let id = EntityId::new("a").unwrap();
        let mut e = f(&id);
        e.on_start(&mut EntityContext::new(
            &id,
            &mut crate::entity::EntityServices::default(),
        ));
        assert_eq!(send(e.as_mut(), &id, "x"), (Status::Ok, "1".into()));
        assert_eq!(send(e.as_mut(), &id, "x"), (Status::Ok, "2".into()));
        let (s, why) = send(e.as_mut(), &id, "boom");
        assert_eq!(s, Status::EntityFailed);
        assert!(why.contains("boom requested"), "{why}");
        // Zero backoff: the next message restarts a fresh child.
        assert_eq!(send(e.as_mut(), &id, "x"), (Status::Ok, "1".into()));
        let (s, _) = send(e.as_mut(), &id, "err");
        assert_eq!(s, Status::EntityFailed);
        assert_eq!(send(e.as_mut(), &id, "x"), (Status::Ok, "1".into()));
    }

    #[test]
    fn panic_restarts_with_fresh_state_and_answers_failure() {
        check_restarts_fresh(supervised(
            Arc::new(|_| Box::new(Fragile { n: 0 })),
            settings(5),
        ));
    }

    #[test]
    fn an_inline_child_restarts_fresh_and_is_held_without_a_box() {
        check_restarts_fresh(supervised_inline(
            Arc::new(|_| Fragile { n: 0 }),
            settings(5),
        ));
        // The child sits in the supervisor: the factory's pointer, the
        // child and the null failure history.
        assert_eq!(
            std::mem::size_of::<Supervisor<Fragile>>(),
            16 + std::mem::size_of::<Option<Fragile>>()
        );
    }

    #[test]
    fn the_failure_history_is_allocated_at_the_first_failure() {
        assert!(std::mem::size_of::<Supervisor>() <= 32);
        let id = EntityId::new("a").unwrap();
        let factory: EntityFactory = Arc::new(|_| Box::new(Fragile { n: 0 }));
        let mut s = Supervisor {
            child: Some(factory(&id)),
            shared: Arc::new((factory, settings(5))),
            history: None,
        };
        assert_eq!(send(&mut s, &id, "x").0, Status::Ok);
        assert!(s.history.is_none());
        assert_eq!(send(&mut s, &id, "boom").0, Status::EntityFailed);
        assert!(s.history.is_some());
        assert_eq!(send(&mut s, &id, "x").0, Status::Ok);
        assert_eq!(s.restarts(), 1);
    }

    #[test]
    fn too_many_restarts_stop_the_entity() {
        let f = supervised(Arc::new(|_| Box::new(Fragile { n: 0 })), settings(2));
        let id = EntityId::new("a").unwrap();
        let mut e = f(&id);
        for _ in 0..2 {
            assert_eq!(send(e.as_mut(), &id, "boom").0, Status::EntityFailed);
            assert_eq!(send(e.as_mut(), &id, "x").0, Status::Ok);
        }
        let mut services = crate::entity::EntityServices::default();
        let mut ctx = EntityContext::new(&id, &mut services).with_reply_token(1);
        e.handle(&mut ctx, b"boom").unwrap();
        assert!(ctx.wants_passivation(), "third failure stops it");
        let (s, why) = send(e.as_mut(), &id, "x");
        assert_eq!(s, Status::EntityFailed);
        assert!(why.contains("too many"), "{why}");
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let s = SupervisorSettings {
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
            random_factor: 0.5,
            ..SupervisorSettings::default()
        };
        assert_eq!(s.backoff(0, 0.0), Duration::from_millis(100));
        assert_eq!(s.backoff(2, 0.0), Duration::from_millis(400));
        assert_eq!(s.backoff(10, 0.0), Duration::from_secs(1));
        assert_eq!(s.backoff(0, 1.0), Duration::from_millis(150));
        assert_eq!(s.backoff(40, 0.0), Duration::from_secs(1));
    }
}
