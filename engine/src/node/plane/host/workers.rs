//! Stateless worker types on a data core (semantics in
//! [`crate::entity::worker`]): the core's pool of each worker type, run
//! by the [`EntityHost`] without the type's region.

use std::time::Duration;

use shardline_core::ids::EntityId;

use super::{
    drop_entity, entity_panicked, panic_as_error, EntityHost, FastMap, ReplyToken, StartFailed,
    UserEnvelope,
};
use crate::entity::worker::{core_share, Admit, WorkerPool, WorkerSettings};
use crate::entity::{catch_panic, Entity, EntityContext, EntityFactory, EntityServices, Outgoing};
use crate::envelope::Status;
use crate::node::plane::data::{DataPlane, TypeIdx};
use crate::status::WorkerPoolStatus;

/// One activation of a worker type.
pub(super) struct Activation {
    /// Dropped by [`Activation`]'s `Drop`, which catches a panic of the
    /// entity's own `Drop`.
    entity: std::mem::ManuallyDrop<Box<dyn Entity>>,
    /// `worker-<core>-<n>`: the id its timers and start run under (a request
    /// runs under the id it addressed).
    id: EntityId,
    incarnation: u64,
    /// Armed timers: (key, due since the core's epoch).
    timers: Vec<(u64, Duration)>,
    /// Messages sent from `on_start`, sent with its first request.
    pending_out: Vec<Outgoing>,
}

impl Drop for Activation {
    fn drop(&mut self) {
        // SAFETY: `entity` is taken once, here, and `self` is not used
        // afterwards.
        let entity = unsafe { std::mem::ManuallyDrop::take(&mut self.entity) };
        drop_entity(entity, "", Some(&self.id));
    }
}

/// The worker side of one entity type on one core.
pub(super) struct WorkerHost {
    pool: WorkerPool<Activation, UserEnvelope>,
    /// The core that runs this core's requests when its share is 0.
    forward_to: Option<u16>,
    /// The node's limit (count).
    max_local_workers: usize,
    /// Deferred replies of busy activations: reply token -> slot.
    deferred: FastMap<ReplyToken, u64>,
}

impl WorkerHost {
    /// The pool of core `index` of `cores` for a type with `settings`.
    pub(super) fn new(
        settings: &WorkerSettings,
        idle_timeout: Option<Duration>,
        cores: usize,
        index: u16,
    ) -> Self {
        let max = settings.max_local_workers.unwrap_or(cores).max(1);
        let share = core_share(max, cores, usize::from(index));
        WorkerHost {
            pool: WorkerPool::new(share, settings.queue_size, idle_timeout),
            // Cores 0..max have a share when max < cores.
            forward_to: (share == 0).then(|| (usize::from(index) % max) as u16),
            max_local_workers: max,
            deferred: FastMap::default(),
        }
    }

    /// The figures of `shardline status` and `/metrics`.
    pub(super) fn status(&self) -> WorkerPoolStatus {
        let s = self.pool.stats();
        WorkerPoolStatus {
            max_local_workers: self.max_local_workers,
            core_limit: self.pool.limit(),
            activations: s.activations,
            max_activations_seen: s.max_activations_seen,
            queued: s.queued,
            executed_locally: s.executed,
            created: s.created,
            collected: s.collected,
            rejected: s.rejected,
        }
    }
}

fn apply_timers(a: &mut Activation, now: Duration, timers: Vec<(u64, Option<Duration>)>) {
    for (key, delay) in timers {
        a.timers.retain(|(k, _)| *k != key);
        if let Some(d) = delay {
            a.timers.push((key, now + d));
        }
    }
}

impl EntityHost {
    /// Runs a request for worker type `ty` here: on an idle or new
    /// activation, or queued; a full queue answers `BufferFull`. Once the
    /// node leaves, requests are answered `ShuttingDown` (retry on another
    /// node): the activations flushed what they held when the leave began,
    /// and nothing they would accept afterwards could be flushed for sure.
    pub(super) fn worker_route(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        mut env: UserEnvelope,
    ) {
        if plane.is_shutting_down() {
            return self.reply(
                env.sender,
                Status::ShuttingDown,
                b"node is leaving: stateless workers take no new requests".to_vec(),
            );
        }
        let inc = self.next_incarnation;
        let core = self.config.core;
        let services = &mut self.services;
        let Some(h) = self.types.get_mut(ty.0) else {
            return;
        };
        let Some(factory) = h.factory.as_ref() else {
            return;
        };
        let Some(w) = h.worker.as_mut() else { return };
        if let Some(to) = w.forward_to {
            return plane.handle_worker_forward(ty, to, env);
        }
        if w.pool.saturated() {
            // It waits in the queue.
            crate::node::plane::data::detach_payload(&mut env.payload);
        }
        let mut created = false;
        let t = &h.name;
        let admit = w.pool.submit(now, env, || {
            created = true;
            make_activation(services, factory, t, core, inc, now)
        });
        if created {
            self.next_incarnation += 1;
            h.activated += 1;
        }
        match admit {
            Admit::Run(slot, env) => self.worker_run(now, plane, ty, slot, env),
            Admit::Queued => {}
            Admit::Full(env) => self.reply(
                env.sender,
                Status::BufferFull,
                b"stateless worker queue full".to_vec(),
            ),
        }
    }

    /// Runs `env` on activation `slot`, then the queued requests it takes
    /// while it stays busy.
    fn worker_run(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        slot: u64,
        env: UserEnvelope,
    ) {
        let mut next = Some((slot, env));
        while let Some((slot, env)) = next.take() {
            let token = self.next_reply_token();
            let Some(h) = self.types.get_mut(ty.0) else {
                return;
            };
            h.delivered += 1;
            let name = h.name.clone();
            let Some(w) = h.worker.as_mut() else {
                return;
            };
            let Some(a) = w.pool.get_mut(slot) else {
                return;
            };
            let mut ctx = EntityContext::new(&env.entity, &mut self.services)
                .with_type(&name, 0)
                .with_reply_token(token.0);
            let entity = &mut a.entity;
            let res = panic_as_error(
                &name,
                Some(&env.entity),
                "handler",
                catch_panic(|| entity.handle(&mut ctx, &env.payload)),
            );
            let inc = a.incarnation;
            apply_timers(a, now, ctx.take_timers());
            let mut out = std::mem::take(&mut a.pending_out);
            out.extend(ctx.take_outgoing());
            let reply = ctx.take_reply().unwrap_or_default();
            let deferred = ctx.reply_deferred();
            drop(ctx);
            let mut sender = Some(env.sender);
            self.send_outgoing(now, out, &mut sender, env.deadline, None);
            match res {
                Ok(()) if deferred => {
                    if let Some(s) = sender {
                        plane.handle_reply_deferred(token.0, inc, s);
                    }
                    if let Some(w) = self.types.get_mut(ty.0).and_then(|h| h.worker.as_mut()) {
                        w.deferred.insert(token, slot);
                    }
                    // Answered already? Then this frees the activation.
                    self.drain_completions(now, plane);
                }
                Ok(()) => {
                    if let Some(s) = sender {
                        self.reply(s, Status::Ok, reply);
                    }
                    next = self
                        .types
                        .get_mut(ty.0)
                        .and_then(|h| h.worker.as_mut())
                        .and_then(|w| w.pool.finish(now, slot))
                        .map(|e| (slot, e));
                }
                Err(e) => {
                    if let Some(s) = sender {
                        self.reply(s, Status::EntityFailed, e.to_string().into_bytes());
                    }
                    next = self.worker_remove(now, plane, ty, slot);
                }
            }
        }
    }

    /// Drops activation `slot` of `ty` (its handler failed); returns the
    /// next queued request with the new activation that runs it.
    fn worker_remove(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        ty: TypeIdx,
        slot: u64,
    ) -> Option<(u64, UserEnvelope)> {
        let inc = self.next_incarnation;
        let core = self.config.core;
        let services = &mut self.services;
        let h = self.types.get_mut(ty.0)?;
        let factory = h.factory.as_ref()?;
        let w = h.worker.as_mut()?;
        let mut created = false;
        let t = &h.name;
        let (gone, next) = w.pool.remove(slot, || {
            created = true;
            make_activation(services, factory, t, core, inc, now)
        });
        if created {
            self.next_incarnation += 1;
            h.activated += 1;
        }
        if let Some(mut a) = gone {
            let name = h.name.clone();
            stop_activation(&mut self.services, &mut a, &name);
            self.fail_deferred(now, plane, a.incarnation);
        }
        next
    }

    /// A deferred reply with `token` was sent: frees its activation, which
    /// takes the next queued request.
    pub(super) fn worker_completed(
        &mut self,
        now: Duration,
        plane: &mut DataPlane,
        token: ReplyToken,
    ) {
        let mut found = None;
        for (i, h) in self.types.iter_mut().enumerate() {
            if let Some(w) = h.worker.as_mut() {
                if let Some(slot) = w.deferred.remove(&token) {
                    found = Some((TypeIdx(i), w.pool.finish(now, slot).map(|e| (slot, e))));
                    break;
                }
            }
        }
        if let Some((ty, Some((slot, env)))) = found {
            self.worker_run(now, plane, ty, slot, env);
        }
    }

    /// Fires the due timers of idle activations and collects the activations
    /// idle past the idle timeout (firing their pending timers first, so an
    /// `aggregate` activation sends its partial sums before it goes).
    pub(super) fn workers_tick(&mut self, now: Duration, plane: &mut DataPlane) {
        for i in 0..self.types.len() {
            let mut out = Vec::new();
            let services = &mut self.services;
            let h = &mut self.types[i];
            let name = h.name.clone();
            let Some(w) = h.worker.as_mut() else {
                continue;
            };
            for (_, busy, a) in w.pool.iter_mut() {
                if busy {
                    continue; // not reentrant: timers wait for the reply
                }
                while let Some(i) = a.timers.iter().position(|(_, due)| *due <= now) {
                    let (key, _) = a.timers.remove(i);
                    fire(services, a, &name, key, now, &mut out);
                }
            }
            for mut a in w.pool.collect_idle(now) {
                while let Some((key, _)) = a.timers.first().copied() {
                    a.timers.remove(0);
                    fire(services, &mut a, &name, key, now, &mut out);
                }
                out.append(&mut a.pending_out);
                stop_activation(services, &mut a, &name);
            }
            self.send_outgoing(now, out, &mut None, None, None);
        }
        // Deferred replies completed by timers.
        self.drain_completions(now, plane);
    }

    /// The node starts leaving: the pending timers of every idle activation
    /// fire now (an `aggregate` activation sends its partial sums while the
    /// cluster can still route them).
    pub(crate) fn handle_graceful_shutdown(&mut self, now: Duration, plane: &mut DataPlane) {
        let mut out = Vec::new();
        let services = &mut self.services;
        for h in self.types.iter_mut() {
            let Some(w) = h.worker.as_mut() else { continue };
            for (_, busy, a) in w.pool.iter_mut() {
                if busy {
                    continue;
                }
                while let Some((key, _)) = a.timers.first().copied() {
                    a.timers.remove(0);
                    fire(services, a, &h.name, key, now, &mut out);
                }
            }
        }
        self.send_outgoing(now, out, &mut None, None, None);
        self.drain_completions(now, plane);
    }

    /// The core stops: every activation is stopped; waiting requests are
    /// answered `ShuttingDown`.
    pub(super) fn workers_stop(&mut self) {
        let mut waiting = Vec::new();
        let services = &mut self.services;
        for h in self.types.iter_mut() {
            if let Some(w) = h.worker.as_mut() {
                let (acts, queued) = w.pool.drain();
                for mut a in acts {
                    stop_activation(services, &mut a, &h.name);
                }
                waiting.extend(queued);
            }
        }
        for env in waiting {
            self.reply(env.sender, Status::ShuttingDown, b"node stopped".to_vec());
        }
    }
}

/// Stops activation `a` of worker type `t` (its deferred replies answered
/// in `on_stop` are sent with the host's next completions).
fn stop_activation(services: &mut EntityServices, a: &mut Activation, t: &str) {
    let mut ctx = EntityContext::new(&a.id, services).with_type(t, 0);
    let entity = &mut a.entity;
    if let Err(why) = catch_panic(|| entity.on_stop(&mut ctx)) {
        entity_panicked(t, Some(&a.id), "on_stop", &why);
    }
}

fn fire(
    services: &mut EntityServices,
    a: &mut Activation,
    t: &str,
    key: u64,
    now: Duration,
    out: &mut Vec<Outgoing>,
) {
    let mut ctx = EntityContext::new(&a.id, services).with_type(t, 0);
    let entity = &mut a.entity;
    // A worker's timer has nobody to answer: a panic is logged, and the
    // activation keeps serving (it holds no state of a sharded entity).
    if let Err(why) = catch_panic(|| entity.on_timer(&mut ctx, key)) {
        entity_panicked(t, Some(&a.id), "timer", &why);
    }
    let timers = ctx.take_timers();
    out.extend(ctx.take_outgoing());
    drop(ctx);
    apply_timers(a, now, timers);
}

fn make_activation(
    services: &mut EntityServices,
    factory: &EntityFactory,
    t: &str,
    core: u16,
    inc: u64,
    now: Duration,
) -> Activation {
    // A short ASCII id: valid (ids are 1..=255 bytes).
    let id = EntityId::new(format!("worker-{core}-{inc}"))
        .unwrap_or_else(|e| unreachable!("worker id is valid: {e}"));
    let mut ctx = EntityContext::new(&id, services).with_type(t, 0);
    // The factory and `on_start` are the user's code: after a panic the
    // activation fails its first request and is replaced.
    let mut made: Option<Box<dyn Entity>> = None;
    let started = catch_panic(|| made.insert(factory(&id)).on_start(&mut ctx));
    let timers = ctx.take_timers();
    let pending_out = ctx.take_outgoing();
    drop(ctx);
    let entity = match (started, made) {
        (Ok(()), Some(e)) => e,
        (started, made) => {
            let why = started.err().unwrap_or_else(|| "no entity".to_string());
            entity_panicked(t, Some(&id), "start", &why);
            if let Some(e) = made {
                drop_entity(e, t, Some(&id));
            }
            Box::new(StartFailed(format!("start panicked: {why}")))
        }
    };
    let mut a = Activation {
        entity: std::mem::ManuallyDrop::new(entity),
        id,
        incarnation: inc,
        timers: Vec::new(),
        pending_out,
    };
    apply_timers(&mut a, now, timers);
    a
}
