//! Stateless workers (Orleans `[StatelessWorker]` semantics): the pool of
//! local activations of one worker type on one data core.
//!
//! Semantics, after the Orleans documentation ("Stateless worker grains",
//! <https://learn.microsoft.com/dotnet/orleans/grains/stateless-worker-grains>,
//! and `StatelessWorkerAttribute(maxLocalWorkers)`; a node that starts the
//! type only as a proxy routes its requests, like a sharded type's, to a
//! node that hosts it, which runs them on its pool — as an incompatible
//! Orleans silo forwards them to a compatible one):
//! - activations are not individually addressable; a request is executed on
//!   the node that received it, never routed through the coordinator or a
//!   shard, so it makes no network hop;
//! - the runtime scans the activations in a fixed order (creation order) and
//!   gives the request to the first idle one; if every activation is busy
//!   and fewer than the limit exist it creates one more; otherwise the
//!   request waits in a bounded queue (full: refused, the sender gets
//!   `BufferFull`);
//! - an activation handles one message at a time (not reentrant): it is
//!   *busy* from the moment it gets a message until its reply is sent —
//!   for a handler that defers its reply ([`super::EntityContext::defer_reply`]),
//!   until the deferred reply completes;
//! - activations idle for longer than the idle timeout are collected, so
//!   the pool grows with load and shrinks when load falls (the fixed-order
//!   scan keeps the first activations busy and lets the last ones go idle).
//!
//! Thread-per-core: the node's `max_local_workers` is split over its data
//! cores ([`core_share`]); each core runs a [`WorkerPool`] with its share as
//! limit and executes the requests it received (a core whose share is 0
//! hands its requests to a core that has one, over the node's cross-core
//! ring — still no network hop). A synchronous handler runs to completion
//! on its core's thread, so it never finds its activation busy: with
//! synchronous handlers the node's concurrency comes from its cores (one
//! busy activation per core at a time), and a core's pool grows past one
//! activation only when handlers defer their replies.
//!
//! The pool is sans-IO: it takes the current time as an argument and never
//! reads a clock, so its unit tests drive time explicitly.

use std::collections::VecDeque;
use std::time::Duration;

/// Default bound of a core's worker queue (messages).
pub const DEFAULT_WORKER_QUEUE_SIZE: usize = crate::config::DEFAULT_WORKER_QUEUE_SIZE as usize;

/// Settings of a stateless worker type (embedding API and config).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerSettings {
    /// Most activations of the type on this node (count); `None`: the
    /// node's number of data cores (as Orleans defaults `maxLocalWorkers`
    /// to the number of CPU cores).
    pub max_local_workers: Option<usize>,
    /// Most requests waiting per data core while every activation is busy
    /// (count). Default [`DEFAULT_WORKER_QUEUE_SIZE`].
    pub queue_size: usize,
}

impl WorkerSettings {
    /// The stateless-worker settings of a configured entity type
    /// (`max_local_workers`, 0 meaning the number of data cores, and
    /// `worker_queue_size`); `None` when the type is not a stateless worker.
    pub fn of_type(t: &crate::config::EntityTypeConfig) -> Option<WorkerSettings> {
        t.is_stateless_worker().then(|| WorkerSettings {
            max_local_workers: (t.max_local_workers > 0).then_some(t.max_local_workers as usize),
            queue_size: t.worker_queue_size as usize,
        })
    }
}

impl Default for WorkerSettings {
    fn default() -> Self {
        WorkerSettings {
            max_local_workers: None,
            queue_size: DEFAULT_WORKER_QUEUE_SIZE,
        }
    }
}

/// The part of a node-wide limit `max` that data core `index` of `cores`
/// runs: `max / cores`, plus one for the first `max % cores` cores, so the
/// shares add up to `max`. A core with share 0 hosts no activation.
pub fn core_share(max: usize, cores: usize, index: usize) -> usize {
    if cores == 0 {
        return 0;
    }
    max / cores + usize::from(index < max % cores)
}

/// The pool's counters and gauges (all counts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Activations now.
    pub activations: usize,
    /// Most activations at one time since start.
    pub max_activations_seen: usize,
    /// Requests waiting now.
    pub queued: usize,
    /// Requests given to an activation (executed locally) since start.
    pub executed: u64,
    /// Activations created since start.
    pub created: u64,
    /// Activations collected after their idle timeout since start.
    pub collected: u64,
    /// Requests refused because the queue was full, since start.
    pub rejected: u64,
}

/// What [`WorkerPool::submit`] did with a request.
#[derive(Debug, PartialEq, Eq)]
pub enum Admit<M> {
    /// Run the request now on activation `slot` (which is now busy); call
    /// [`WorkerPool::finish`] when its reply is sent.
    Run(u64, M),
    /// Every activation is busy and the limit is reached: the request waits.
    Queued,
    /// The queue is full: the request is refused and given back.
    Full(M),
}

struct Slot<A> {
    id: u64,
    activation: A,
    busy: bool,
    idle_since: Duration,
}

/// The activations of one worker type on one data core, and its queue.
pub struct WorkerPool<A, M> {
    slots: Vec<Slot<A>>,
    limit: usize,
    queue: VecDeque<M>,
    queue_size: usize,
    idle_timeout: Option<Duration>,
    next_id: u64,
    stats: PoolStats,
}

impl<A, M> WorkerPool<A, M> {
    /// An empty pool of at most `limit` activations, `queue_size` waiting
    /// requests, collecting activations idle for `idle_timeout` (`None`:
    /// never).
    pub fn new(limit: usize, queue_size: usize, idle_timeout: Option<Duration>) -> Self {
        WorkerPool {
            slots: Vec::new(),
            limit,
            queue: VecDeque::new(),
            queue_size,
            idle_timeout,
            next_id: 1,
            stats: PoolStats::default(),
        }
    }

    /// The most activations this pool creates (count).
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Whether [`Self::submit`] would queue (or refuse) a message now: every
    /// activation is busy and the limit is reached.
    pub fn saturated(&self) -> bool {
        self.slots.len() >= self.limit && self.slots.iter().all(|s| s.busy)
    }

    /// Gives `msg` to the first idle activation in creation order; creates
    /// one with `make` if all are busy and the limit allows; else queues it.
    pub fn submit(&mut self, now: Duration, msg: M, make: impl FnOnce() -> A) -> Admit<M> {
        if let Some(s) = self.slots.iter_mut().find(|s| !s.busy) {
            s.busy = true;
            self.stats.executed += 1;
            return Admit::Run(s.id, msg);
        }
        if self.slots.len() < self.limit {
            let id = self.next_id;
            self.next_id += 1;
            self.slots.push(Slot {
                id,
                activation: make(),
                busy: true,
                idle_since: now,
            });
            self.stats.created += 1;
            self.stats.executed += 1;
            self.stats.max_activations_seen = self.stats.max_activations_seen.max(self.slots.len());
            return Admit::Run(id, msg);
        }
        if self.queue.len() >= self.queue_size {
            self.stats.rejected += 1;
            return Admit::Full(msg);
        }
        self.queue.push_back(msg);
        Admit::Queued
    }

    /// Activation `slot` sent its reply. Returns the next queued request,
    /// which it runs now (it stays busy), or `None` (it is idle from `now`).
    pub fn finish(&mut self, now: Duration, slot: u64) -> Option<M> {
        let s = self.slots.iter_mut().find(|s| s.id == slot)?;
        if let Some(m) = self.queue.pop_front() {
            self.stats.executed += 1;
            return Some(m);
        }
        s.busy = false;
        s.idle_since = now;
        None
    }

    /// Removes activation `slot` (its handler failed). Returns it, and the
    /// next queued request with the slot of a new activation made by `make`
    /// to run it on, if one was waiting.
    pub fn remove(&mut self, slot: u64, make: impl FnOnce() -> A) -> (Option<A>, Option<(u64, M)>) {
        let a = self
            .slots
            .iter()
            .position(|s| s.id == slot)
            .map(|i| self.slots.remove(i).activation);
        let next = match self.queue.pop_front() {
            None => None,
            Some(m) => {
                let id = self.next_id;
                self.next_id += 1;
                self.slots.push(Slot {
                    id,
                    activation: make(),
                    busy: true,
                    idle_since: Duration::ZERO,
                });
                self.stats.created += 1;
                self.stats.executed += 1;
                Some((id, m))
            }
        };
        (a, next)
    }

    /// The activation of `slot`.
    pub fn get_mut(&mut self, slot: u64) -> Option<&mut A> {
        self.slots
            .iter_mut()
            .find(|s| s.id == slot)
            .map(|s| &mut s.activation)
    }

    /// Whether activation `slot` is handling a message.
    pub fn is_busy(&self, slot: u64) -> bool {
        self.slots.iter().any(|s| s.id == slot && s.busy)
    }

    /// The activations in scan order, with their slot and whether busy.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (u64, bool, &mut A)> + '_ {
        self.slots
            .iter_mut()
            .map(|s| (s.id, s.busy, &mut s.activation))
    }

    /// Removes and returns the idle activations whose idle time reached the
    /// idle timeout at `now`.
    pub fn collect_idle(&mut self, now: Duration) -> Vec<A> {
        let Some(t) = self.idle_timeout else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut i = 0;
        while i < self.slots.len() {
            let s = &self.slots[i];
            if !s.busy && now.saturating_sub(s.idle_since) >= t {
                out.push(self.slots.remove(i).activation);
            } else {
                i += 1;
            }
        }
        self.stats.collected += out.len() as u64;
        out
    }

    /// Removes every activation and waiting request (the core stops).
    pub fn drain(&mut self) -> (Vec<A>, Vec<M>) {
        let a = self.slots.drain(..).map(|s| s.activation).collect();
        (a, self.queue.drain(..).collect())
    }

    /// The pool's figures now.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            activations: self.slots.len(),
            queued: self.queue.len(),
            ..self.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Activations are numbered by creation; messages are u32.
    fn pool(limit: usize, queue: usize) -> (WorkerPool<u32, u32>, u32) {
        (WorkerPool::new(limit, queue, Some(ms(100))), 0)
    }

    fn submit(p: &mut WorkerPool<u32, u32>, made: &mut u32, now: u64, m: u32) -> Admit<u32> {
        p.submit(ms(now), m, || {
            *made += 1;
            *made
        })
    }

    #[test]
    fn grows_only_while_all_are_busy_and_stops_at_the_limit() {
        let (mut p, mut made) = pool(3, 10);
        let Admit::Run(a, 1) = submit(&mut p, &mut made, 0, 1) else {
            panic!()
        };
        // `a` is busy: a second activation.
        let Admit::Run(b, 2) = submit(&mut p, &mut made, 0, 2) else {
            panic!()
        };
        assert_ne!(a, b);
        // `a` finishes: the next request reuses it, no new activation.
        assert_eq!(p.finish(ms(1), a), None);
        assert_eq!(submit(&mut p, &mut made, 1, 3), Admit::Run(a, 3));
        assert_eq!(made, 2);
        let Admit::Run(c, 4) = submit(&mut p, &mut made, 1, 4) else {
            panic!()
        };
        assert_eq!(made, 3);
        // All 3 busy at the limit: queued, no fourth activation.
        assert_eq!(submit(&mut p, &mut made, 1, 5), Admit::Queued);
        assert_eq!(made, 3);
        let s = p.stats();
        assert_eq!((s.activations, s.max_activations_seen, s.queued), (3, 3, 1));
        assert_eq!(s.executed, 4);
        // The queued request runs on the first activation to finish.
        assert_eq!(p.finish(ms(2), c), Some(5));
        assert!(p.is_busy(c));
        assert_eq!(p.stats().executed, 5);
    }

    #[test]
    fn the_queue_is_bounded() {
        let (mut p, mut made) = pool(1, 2);
        assert!(matches!(submit(&mut p, &mut made, 0, 1), Admit::Run(_, 1)));
        assert_eq!(submit(&mut p, &mut made, 0, 2), Admit::Queued);
        assert_eq!(submit(&mut p, &mut made, 0, 3), Admit::Queued);
        assert_eq!(submit(&mut p, &mut made, 0, 4), Admit::Full(4));
        let s = p.stats();
        assert_eq!((s.queued, s.rejected, s.activations), (2, 1, 1));
    }

    #[test]
    fn scans_in_creation_order() {
        let (mut p, mut made) = pool(3, 0);
        let slots: Vec<u64> = (0..3)
            .map(|i| match submit(&mut p, &mut made, 0, i) {
                Admit::Run(s, _) => s,
                other => panic!("{other:?}"),
            })
            .collect();
        // Whatever order they finish in, the first idle one in creation
        // order gets the request.
        p.finish(ms(1), slots[2]);
        p.finish(ms(1), slots[1]);
        assert_eq!(submit(&mut p, &mut made, 1, 9), Admit::Run(slots[1], 9));
        p.finish(ms(1), slots[0]);
        assert_eq!(submit(&mut p, &mut made, 1, 10), Admit::Run(slots[0], 10));
        assert_eq!(submit(&mut p, &mut made, 1, 11), Admit::Run(slots[2], 11));
        // Zero queue: the next one is refused.
        assert_eq!(submit(&mut p, &mut made, 1, 12), Admit::Full(12));
    }

    #[test]
    fn shrinks_after_the_idle_timeout() {
        let (mut p, mut made) = pool(4, 10);
        let slots: Vec<u64> = (0..4)
            .map(|i| match submit(&mut p, &mut made, 0, i) {
                Admit::Run(s, _) => s,
                other => panic!("{other:?}"),
            })
            .collect();
        for s in &slots {
            p.finish(ms(10), *s);
        }
        // Light load afterwards: always the first activation.
        for t in [20, 50, 80, 105] {
            assert_eq!(submit(&mut p, &mut made, t, 0), Admit::Run(slots[0], 0));
            p.finish(ms(t), slots[0]);
        }
        assert!(p.collect_idle(ms(109)).is_empty());
        // The other three were idle since 10 ms: collected at 110 ms.
        assert_eq!(p.collect_idle(ms(110)), vec![2, 3, 4]);
        let s = p.stats();
        assert_eq!(
            (s.activations, s.collected, s.max_activations_seen),
            (1, 3, 4)
        );
        // A busy activation is never collected.
        assert!(matches!(
            submit(&mut p, &mut made, 300, 1),
            Admit::Run(_, 1)
        ));
        assert!(p.collect_idle(ms(1000)).is_empty());
    }

    #[test]
    fn shares_add_up_to_the_limit() {
        for cores in 1..6 {
            for max in 0..20 {
                let sum: usize = (0..cores).map(|i| core_share(max, cores, i)).sum();
                assert_eq!(sum, max, "max {max} cores {cores}");
            }
        }
        assert_eq!(core_share(1, 2, 1), 0);
    }

    #[test]
    fn a_failed_activation_is_replaced_for_the_waiting_request() {
        let (mut p, mut made) = pool(1, 4);
        let Admit::Run(a, _) = submit(&mut p, &mut made, 0, 1) else {
            panic!()
        };
        assert_eq!(submit(&mut p, &mut made, 0, 2), Admit::Queued);
        let (gone, next) = p.remove(a, || 99);
        assert_eq!(gone, Some(1));
        let (b, m) = next.unwrap();
        assert_eq!(m, 2);
        assert_eq!(p.get_mut(b), Some(&mut 99));
        assert_eq!(p.stats().activations, 1);
    }
}
