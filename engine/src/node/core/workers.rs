//! Stateless worker types on a data core (semantics in
//! [`crate::entity::worker`]): the core's pool of each worker type, run
//! without the type's region, and the messages entities send
//! ([`crate::entity::EntityContext::tell`] / `forward`).

use std::time::Duration;

use shardline_core::ids::EntityId;
use shardline_core::sharding::{shard_id_of, Envelope};

use super::{DataExecutor, FastMap, ReplyTo, ToCore, UserEnvelope};
use crate::entity::worker::{core_share, Admit, WorkerPool, WorkerSettings};
use crate::entity::{Entity, EntityContext, EntityFactory, Outgoing};
use crate::envelope::Status;
use crate::status::WorkerPoolStatus;

/// One activation of a worker type.
pub(super) struct Activation {
    entity: Box<dyn Entity>,
    /// `worker-<core>-<n>`: the id its timers and start run under (a request
    /// runs under the id it addressed).
    id: EntityId,
    incarnation: u64,
    /// Armed timers: (key, due since the core's epoch).
    timers: Vec<(u64, Duration)>,
    /// Messages sent from `on_start`, sent with its first request.
    pending_out: Vec<Outgoing>,
}

/// The worker side of one entity type on one core.
pub(super) struct WorkerHost {
    pool: WorkerPool<Activation, UserEnvelope>,
    /// The core that runs this core's requests when its share is 0.
    forward_to: Option<u16>,
    /// The node's limit (count).
    max_local_workers: usize,
    /// Deferred replies of busy activations: reply token -> slot.
    deferred: FastMap<u64, u64>,
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

impl DataExecutor {
    /// Runs a request for worker type `t` here: on an idle or new
    /// activation, or queued; a full queue answers `BufferFull`. Once the
    /// node leaves, requests are answered `ShuttingDown` (retry on another
    /// node): the activations flushed what they held when the leave began,
    /// and nothing they would accept afterwards could be flushed for sure.
    pub(super) fn worker_route(&mut self, t: &str, env: UserEnvelope) {
        if self.plane.is_shutting_down() {
            return self.reply(
                env.sender,
                Status::ShuttingDown,
                b"node is leaving: stateless workers take no new requests".to_vec(),
            );
        }
        let now = self.now();
        let inc = self.next_incarnation;
        let core = self.index;
        let Some(h) = self.types.get_mut(t) else {
            return;
        };
        let Some(factory) = h.factory.as_ref() else {
            return;
        };
        let Some(w) = h.worker.as_mut() else { return };
        if let Some(to) = w.forward_to {
            let Some(ty) = self.plane.type_index(t) else {
                return;
            };
            return self.plane.handle_worker_forward(ty, to, env);
        }
        let mut created = false;
        let admit = w.pool.submit(now, env, || {
            created = true;
            make_activation(factory, t, core, inc, now)
        });
        if created {
            self.next_incarnation += 1;
            if let Some(h) = self.types.get_mut(t) {
                h.activated += 1;
            }
        }
        match admit {
            Admit::Run(slot, env) => self.worker_run(t, slot, env),
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
    fn worker_run(&mut self, t: &str, slot: u64, env: UserEnvelope) {
        let mut next = Some((slot, env));
        while let Some((slot, env)) = next.take() {
            let now = self.now();
            let token = self.next_tag;
            self.next_tag += 1;
            let Some(h) = self.types.get_mut(t) else {
                return;
            };
            h.delivered += 1;
            let Some(w) = h.worker.as_mut() else {
                return;
            };
            let Some(a) = w.pool.get_mut(slot) else {
                return;
            };
            let mut ctx = EntityContext::new(&env.entity)
                .with_type(t, 0)
                .with_reply_token(token);
            let res = a.entity.handle(&mut ctx, &env.payload);
            let inc = a.incarnation;
            apply_timers(a, now, ctx.take_timers());
            let mut out = std::mem::take(&mut a.pending_out);
            out.extend(ctx.take_outgoing());
            let reply = ctx.take_reply().unwrap_or_default();
            let deferred = ctx.reply_deferred();
            drop(ctx);
            let mut sender = Some(env.sender);
            self.send_outgoing(out, &mut sender, env.deadline);
            match res {
                Ok(()) if deferred => {
                    if let Some(s) = sender {
                        self.plane.handle_reply_deferred(token, inc, s);
                    }
                    if let Some(w) = self.types.get_mut(t).and_then(|h| h.worker.as_mut()) {
                        w.deferred.insert(token, slot);
                    }
                    // Answered already? Then this frees the activation.
                    self.drain_completions();
                }
                Ok(()) => {
                    if let Some(s) = sender {
                        self.reply(s, Status::Ok, reply);
                    }
                    next = self
                        .types
                        .get_mut(t)
                        .and_then(|h| h.worker.as_mut())
                        .and_then(|w| w.pool.finish(now, slot))
                        .map(|e| (slot, e));
                }
                Err(e) => {
                    if let Some(s) = sender {
                        self.reply(s, Status::EntityFailed, e.to_string().into_bytes());
                    }
                    next = self.worker_remove(t, slot);
                }
            }
        }
    }

    /// Drops activation `slot` of `t` (its handler failed); returns the next
    /// queued request with the new activation that runs it.
    fn worker_remove(&mut self, t: &str, slot: u64) -> Option<(u64, UserEnvelope)> {
        let now = self.now();
        let inc = self.next_incarnation;
        let core = self.index;
        let h = self.types.get_mut(t)?;
        let factory = h.factory.as_ref()?;
        let w = h.worker.as_mut()?;
        let mut created = false;
        let (gone, next) = w.pool.remove(slot, || {
            created = true;
            make_activation(factory, t, core, inc, now)
        });
        if created {
            self.next_incarnation += 1;
            if let Some(h) = self.types.get_mut(t) {
                h.activated += 1;
            }
        }
        if let Some(mut a) = gone {
            a.entity.on_stop();
            self.fail_deferred(a.incarnation);
        }
        next
    }

    /// A deferred reply with `token` was sent: frees its activation, which
    /// takes the next queued request.
    pub(super) fn worker_completed(&mut self, token: u64) {
        let now = self.now();
        let mut found = None;
        for (t, h) in self.types.entries.iter_mut() {
            if let Some(w) = h.worker.as_mut() {
                if let Some(slot) = w.deferred.remove(&token) {
                    found = Some((t.clone(), w.pool.finish(now, slot).map(|e| (slot, e))));
                    break;
                }
            }
        }
        if let Some((t, Some((slot, env)))) = found {
            self.worker_run(&t, slot, env);
        }
    }

    /// Fires the due timers of idle activations and collects the activations
    /// idle past the idle timeout (firing their pending timers first, so an
    /// `aggregate` activation sends its partial sums before it goes).
    pub(super) fn workers_tick(&mut self, now: Duration) {
        let types: Vec<std::rc::Rc<str>> = self
            .types
            .entries
            .iter()
            .filter(|(_, h)| h.worker.is_some())
            .map(|(t, _)| t.clone())
            .collect();
        for t in types {
            let mut out = Vec::new();
            let Some(w) = self.types.get_mut(&t).and_then(|h| h.worker.as_mut()) else {
                continue;
            };
            for (_, busy, a) in w.pool.iter_mut() {
                if busy {
                    continue; // not reentrant: timers wait for the reply
                }
                while let Some(i) = a.timers.iter().position(|(_, due)| *due <= now) {
                    let (key, _) = a.timers.remove(i);
                    fire(a, &t, key, now, &mut out);
                }
            }
            for mut a in w.pool.collect_idle(now) {
                while let Some((key, _)) = a.timers.first().copied() {
                    a.timers.remove(0);
                    fire(&mut a, &t, key, now, &mut out);
                }
                out.append(&mut a.pending_out);
                a.entity.on_stop();
            }
            self.send_outgoing(out, &mut None, None);
        }
        // Deferred replies completed by timers.
        self.drain_completions();
    }

    /// The node starts leaving: the pending timers of every idle activation
    /// fire now (an `aggregate` activation sends its partial sums while the
    /// cluster can still route them).
    pub(super) fn workers_flush(&mut self, now: Duration) {
        let mut out = Vec::new();
        for (t, h) in self.types.entries.iter_mut() {
            let Some(w) = h.worker.as_mut() else { continue };
            for (_, busy, a) in w.pool.iter_mut() {
                if busy {
                    continue;
                }
                while let Some((key, _)) = a.timers.first().copied() {
                    a.timers.remove(0);
                    fire(a, t, key, now, &mut out);
                }
            }
        }
        self.send_outgoing(out, &mut None, None);
        self.drain_completions();
    }

    /// The core stops: every activation is stopped; waiting requests are
    /// answered `ShuttingDown`.
    pub(super) fn workers_stop(&mut self) {
        let mut waiting = Vec::new();
        for h in self.types.entries.iter_mut().map(|(_, h)| h) {
            if let Some(w) = h.worker.as_mut() {
                let (acts, queued) = w.pool.drain();
                for mut a in acts {
                    a.entity.on_stop();
                }
                waiting.extend(queued);
            }
        }
        for env in waiting {
            self.reply(env.sender, Status::ShuttingDown, b"node stopped".to_vec());
        }
    }

    /// Routes the messages a handler sent, through this core's own inbox (so
    /// a handler never runs inside another's). A forward takes `sender` and
    /// `deadline`, the ask deadline of the message being handled: the
    /// original sender stops waiting then, so a forward still buffered at
    /// that time is answered `Unavailable` and never delivered later.
    pub(super) fn send_outgoing(
        &mut self,
        out: Vec<Outgoing>,
        sender: &mut Option<ReplyTo>,
        handled_deadline: Option<Duration>,
    ) {
        for o in out {
            let mut deadline = None;
            let to = if let Some(a) = &o.ask {
                // An ask between entities: its answer comes back to the
                // asking incarnation (`DataExecutor::answer_entity_ask`).
                let inc = self
                    .types
                    .get(&a.from_type)
                    .and_then(|h| h.entities.get(&a.from_id))
                    .map(|l| l.incarnation);
                let Some(incarnation) = inc else {
                    tracing::warn!(
                        entity = %a.from_id,
                        "ask dropped: only sharded entities can ask"
                    );
                    continue;
                };
                let now = self.now();
                self.entity_asks.insert(
                    a.id.0,
                    super::EntityAskWait {
                        type_name: a.from_type.clone(),
                        entity: a.from_id.clone(),
                        incarnation,
                        due: now.saturating_add(a.timeout),
                    },
                );
                self.entity_ask_expiry
                    .push(std::cmp::Reverse((now.saturating_add(a.timeout), a.id.0)));
                deadline = Some(now + a.timeout.min(self.config.requests.ask_timeout()));
                ReplyTo::EntityAsk { id: a.id.0 }
            } else if o.forward {
                deadline = handled_deadline;
                sender.take().unwrap_or(ReplyTo::Nobody)
            } else {
                ReplyTo::Nobody
            };
            let envelope = Envelope {
                deadline,
                shard: shard_id_of(o.entity_id.as_str(), self.config.number_of_shards),
                entity: o.entity_id,
                sender: to,
                payload: o.payload,
            };
            let Some(tx) = self.to_cores.get(usize::from(self.index)) else {
                continue;
            };
            if let Err(e) = tx.send(ToCore::Forwarded {
                type_name: o.type_name,
                envelope,
            }) {
                tracing::warn!(
                    core = self.index,
                    "message between entities dropped: inbox full or closed"
                );
                let (crate::runtime::RingSendError::Full(m)
                | crate::runtime::RingSendError::Closed(m)) = e;
                if let ToCore::Forwarded { envelope, .. } = m {
                    self.reply(
                        envelope.sender,
                        Status::BufferFull,
                        b"core inbox full".to_vec(),
                    );
                }
            }
        }
    }
}

fn fire(a: &mut Activation, t: &str, key: u64, now: Duration, out: &mut Vec<Outgoing>) {
    let mut ctx = EntityContext::new(&a.id).with_type(t, 0);
    a.entity.on_timer(&mut ctx, key);
    let timers = ctx.take_timers();
    out.extend(ctx.take_outgoing());
    drop(ctx);
    apply_timers(a, now, timers);
}

fn make_activation(
    factory: &EntityFactory,
    t: &str,
    core: u16,
    inc: u64,
    now: Duration,
) -> Activation {
    // A short ASCII id: valid (ids are 1..=255 bytes).
    let id = EntityId::new(format!("worker-{core}-{inc}"))
        .unwrap_or_else(|e| unreachable!("worker id is valid: {e}"));
    let mut entity = factory(&id);
    let mut ctx = EntityContext::new(&id).with_type(t, 0);
    entity.on_start(&mut ctx);
    let timers = ctx.take_timers();
    let pending_out = ctx.take_outgoing();
    drop(ctx);
    let mut a = Activation {
        entity,
        id,
        incarnation: inc,
        timers: Vec::new(),
        pending_out,
    };
    apply_timers(&mut a, now, timers);
    a
}
