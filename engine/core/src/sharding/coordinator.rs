//! The ShardCoordinator: decides shard homes, runs hand-offs and rebalances.
//!
//! Protocol after Akka's `ShardCoordinator` (Akka Cluster Sharding docs,
//! "Shard location", "Shard rebalancing"):
//! - `Register` → `RegisterAck` (+ `ShardHomes` of what the region owns);
//!   after a recovery, a shard the region reports as stopping (it got the
//!   previous coordinator's `HandOff`) resumes its hand-off at its last step,
//!   waiting for `ShardStopped`, and `GetShardHome` for a shard whose
//!   recorded home has not registered again waits for that `Register` (or
//!   the re-register deadline), so the stopping owner is never named as a
//!   home (see "Ordering" in `region.rs`);
//! - `GetShardHome` → allocation through the [`ShardAllocationStrategy`] →
//!   `Persist(ShardHomeAllocated)` → `ShardHome` to the home and every asker;
//! - a rebalance round every `rebalance_interval`: for each chosen shard,
//!   `BeginHandOff` to every region → `BeginHandOffAck` from each (terminated
//!   regions count as acked) → `HandOff` to the owner → `ShardStopped` →
//!   `Persist(ShardHomeDeallocated)` → deferred `GetShardHome`s are answered
//!   with a new allocation. A hand-off not finished within `handoff_timeout`
//!   is abandoned: the shard stays with its owner under a new generation.
//!   When `HandOff` had been sent, the owner may still be stopping the
//!   shard: no new hand-off of it starts until the owner reports that stop
//!   (or [`STILL_STOPPING_WAIT_TIMEOUTS`] more `handoff_timeout`s pass).
//!   An operator may run a round at once ([`ShardCoordinator::rebalance_now`]);
//!   [`ShardCoordinator::allocation`] is the allocation table they read.
//!
//! The state ([`CoordinatorState`]) changes only by applying the events the
//! coordinator emits, so replaying the journal gives back the same state.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use super::strategy::ShardAllocationStrategy;
use super::{CoordinatorMsg, Generation, MemberStatus, MembershipEvent, RegionMsg};
use crate::ids::{RegionId, ShardId, UniqueAddress};

/// A persisted coordinator event (past tense, as in Akka's
/// `ShardCoordinator.Internal.DomainEvent`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordinatorEvent {
    /// A region registered.
    ShardRegionRegistered {
        /// The region.
        region: RegionId,
    },
    /// A proxy registered.
    ShardRegionProxyRegistered {
        /// The proxy.
        proxy: RegionId,
    },
    /// A region terminated; its shards were deallocated by the events before.
    ShardRegionTerminated {
        /// The region.
        region: RegionId,
    },
    /// A proxy terminated.
    ShardRegionProxyTerminated {
        /// The proxy.
        proxy: RegionId,
    },
    /// A shard got a home.
    ShardHomeAllocated {
        /// The shard.
        shard: ShardId,
        /// Its home.
        region: RegionId,
        /// The allocation's generation (larger than every earlier one).
        generation: Generation,
    },
    /// A shard lost its home (handed off, or its region terminated).
    ShardHomeDeallocated {
        /// The shard.
        shard: ShardId,
        /// The generation of the allocation that ended.
        generation: Generation,
    },
    /// With remember entities on: a shard that lost its home must be
    /// allocated again without waiting for a message, so that its remembered
    /// entities start again (Akka's `ShardCoordinator` state
    /// `unallocatedShards`). Cleared by the shard's next
    /// [`ShardHomeAllocated`](Self::ShardHomeAllocated).
    ShardUnallocated {
        /// The shard.
        shard: ShardId,
    },
}

/// The coordinator's durable state: a fold over [`CoordinatorEvent`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CoordinatorState {
    /// Each allocated shard's home and generation.
    pub shards: BTreeMap<ShardId, (RegionId, Generation)>,
    /// Each registered region and the shards it hosts.
    pub regions: BTreeMap<RegionId, BTreeSet<ShardId>>,
    /// Registered proxies.
    pub proxies: BTreeSet<RegionId>,
    /// The largest generation ever allocated (0 = none yet).
    pub last_generation: Generation,
    /// Shards without a home that must be allocated again without waiting
    /// for a message (remember entities; Akka's `unallocatedShards`).
    pub unallocated: BTreeSet<ShardId>,
}

impl CoordinatorState {
    /// Applies one event.
    pub fn apply(&mut self, event: &CoordinatorEvent) {
        match event {
            CoordinatorEvent::ShardRegionRegistered { region } => {
                self.regions.entry(region.clone()).or_default();
            }
            CoordinatorEvent::ShardRegionProxyRegistered { proxy } => {
                self.proxies.insert(proxy.clone());
            }
            CoordinatorEvent::ShardRegionTerminated { region } => {
                if let Some(shards) = self.regions.remove(region) {
                    for s in shards {
                        self.shards.remove(&s);
                    }
                }
            }
            CoordinatorEvent::ShardRegionProxyTerminated { proxy } => {
                self.proxies.remove(proxy);
            }
            CoordinatorEvent::ShardHomeAllocated {
                shard,
                region,
                generation,
            } => {
                if let Some((old, _)) = self.shards.remove(shard) {
                    if let Some(set) = self.regions.get_mut(&old) {
                        set.remove(shard);
                    }
                }
                self.shards.insert(*shard, (region.clone(), *generation));
                self.regions
                    .entry(region.clone())
                    .or_default()
                    .insert(*shard);
                self.last_generation = self.last_generation.max(*generation);
                self.unallocated.remove(shard);
            }
            CoordinatorEvent::ShardUnallocated { shard } => {
                if !self.shards.contains_key(shard) {
                    self.unallocated.insert(*shard);
                }
            }
            CoordinatorEvent::ShardHomeDeallocated { shard, .. } => {
                if let Some((old, _)) = self.shards.remove(shard) {
                    if let Some(set) = self.regions.get_mut(&old) {
                        set.remove(shard);
                    }
                }
            }
        }
    }

    /// The state after applying `events` in order to the empty state.
    pub fn from_events<'a>(events: impl IntoIterator<Item = &'a CoordinatorEvent>) -> Self {
        let mut s = Self::default();
        for e in events {
            s.apply(e);
        }
        s
    }
}

/// Coordinator settings (Akka's `akka.cluster.sharding` keys of the same
/// meaning).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorSettings {
    /// Up members needed before the first allocation (count). Default 1.
    pub min_nr_of_members: usize,
    /// Time between rebalance rounds. Default 10 s.
    pub rebalance_interval: Duration,
    /// How long one shard's hand-off may take before it is abandoned.
    /// Default 60 s.
    pub handoff_timeout: Duration,
    /// A floor for allocation generations: every new allocation gets a
    /// generation above both this and every recovered one. Default 0.
    ///
    /// Generations are the writer epochs of durable entities' journal
    /// appends, so they must never go backwards, also across a restart of
    /// the whole cluster. A runtime whose coordinator journal does not
    /// survive such a restart sets this from a clock at the coordinator's
    /// start (milliseconds since the Unix epoch), so a new cluster never
    /// hands out an epoch below one an earlier run wrote with.
    pub min_generation: Generation,
    /// How long a recovered coordinator waits for the regions of its
    /// recovered state to register again. At the deadline, the recorded
    /// regions that did not, and whose member is not Up (e.g. Leaving), are
    /// terminated: their shards are deallocated and allocated anew on
    /// demand. Regions of members that are no longer in the membership are
    /// terminated at once; regions of Up members are kept (terminating a
    /// live region would give its shards a second home; if the member dies,
    /// its removal terminates them). Until a recorded region registered
    /// again (or the deadline settled it), `GetShardHome` for its shards is
    /// not answered: its `Register` says whether it is still stopping them
    /// after an earlier coordinator's `HandOff` (see
    /// [`CoordinatorMsg::Register`]). Default 10 s. (Akka: a recovered
    /// coordinator watches the recorded regions and drops those that are
    /// gone.)
    pub reregister_timeout: Duration,
    /// The entity type remembers its entities (Akka's
    /// `akka.cluster.sharding.remember-entities`). When on, a shard that
    /// loses its home (its region terminated, a rebalance hand-off finished,
    /// or its region is gone after the coordinator's recovery) is allocated
    /// again at once, without waiting for a message, so its new home starts
    /// it and restarts its remembered entities (Akka's
    /// `allocateShardHomesForRememberEntities`). Default false.
    pub remember_entities: bool,
    /// The entity type's `number_of_shards` (count) for warm allocation;
    /// 0 (the default) turns it off (shards are allocated on demand only).
    ///
    /// When set, the coordinator allocates every shard of `0..number_of_shards`
    /// that has no home in one batch, through the allocation strategy, as
    /// soon as its registered regions have settled (no region registered
    /// and no member became Up for [`Self::warm_settle`], and a recovered
    /// coordinator's regions all registered again), records the batch as
    /// consecutive `ShardHomeAllocated` events (one durability round for the
    /// runtime) and tells every registered region and proxy the homes
    /// ([`RegionMsg::ShardHomes`], at most [`WARM_HOMES_PER_MESSAGE`] per
    /// message). A region that registers gets every known home. Shards
    /// that lose their home later (their region terminated, a hand-off
    /// finished) are allocated again the same way. Shards the batch could
    /// not place (no eligible region) are still allocated on demand.
    pub number_of_shards: u32,
    /// How long the registered regions must stay unchanged before a warm
    /// batch runs (see [`Self::number_of_shards`]), so that the regions of
    /// every core of a member that just started share it. Default 200 ms.
    pub warm_settle: Duration,
}

/// Most (shard, home, generation) triples in one [`RegionMsg::ShardHomes`]
/// a coordinator sends (count), so a control frame stays small.
pub const WARM_HOMES_PER_MESSAGE: usize = 4096;

impl Default for CoordinatorSettings {
    fn default() -> Self {
        Self {
            min_nr_of_members: 1,
            rebalance_interval: Duration::from_secs(10),
            handoff_timeout: Duration::from_secs(60),
            min_generation: Generation(0),
            reregister_timeout: Duration::from_secs(10),
            remember_entities: false,
            number_of_shards: 0,
            warm_settle: Duration::from_millis(200),
        }
    }
}

/// An effect for the runtime to carry out, in order.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordinatorEffect {
    /// Send a control message to a region.
    Send {
        /// The destination region.
        to: RegionId,
        /// The message.
        msg: RegionMsg,
    },
    /// Append the event to the coordinator's journal; it must be durable
    /// before any later effect is carried out.
    Persist(CoordinatorEvent),
}

/// A hand-off the coordinator abandoned at its `handoff_timeout` (the shard
/// stays with its owner under a new generation), for the runtime to log
/// ([`ShardCoordinator::take_abandoned_hand_offs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbandonedHandOff {
    /// The shard.
    pub shard: ShardId,
    /// Its owner, which keeps it.
    pub owner: RegionId,
    /// The generation of the abandoned round.
    pub generation: Generation,
    /// Why: which step did not finish in time (regions that did not
    /// acknowledge `BeginHandOff`, or the owner's missing `ShardStopped`).
    pub reason: String,
}

/// Where a hand-off is ([`HandOffView::phase`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandOffPhase {
    /// `BeginHandOff` sent; waiting for this many regions' `BeginHandOffAck`
    /// (count). The owner acknowledges directly, every other region through
    /// the owner (behind what it forwarded to it), so while the owner does
    /// not answer (a frozen member) every region's ack is pending; a region
    /// whose member is removed counts as acknowledged.
    WaitingForAcks {
        /// Regions whose ack has not reached the coordinator yet (count).
        pending: usize,
    },
    /// `HandOff` sent to the owner; waiting for its `ShardStopped`.
    Stopping,
}

/// A shard's hand-off in progress, as [`ShardCoordinator::allocation`]
/// shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandOffView {
    /// When it started, on the clock the coordinator is fed.
    pub since: Duration,
    /// When it is abandoned if not finished, on the same clock.
    pub deadline: Duration,
    /// The region the allocation strategy picked for the shard when the
    /// hand-off started, counting the round's earlier moves (`None` when
    /// it was started by a graceful shutdown of the owner or the strategy
    /// gave no answer). The shard's new home is decided when it is
    /// allocated again after it stopped (on the next `GetShardHome` for
    /// it), by the same strategy and the loads of that moment, so it may
    /// differ.
    pub planned_target: Option<RegionId>,
    /// Where it is.
    pub phase: HandOffPhase,
}

/// One allocated shard in [`ShardCoordinator::allocation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardAllocation {
    /// The shard.
    pub shard: ShardId,
    /// Its home.
    pub region: RegionId,
    /// The generation of its allocation.
    pub generation: Generation,
    /// Its hand-off, when one is in progress.
    pub hand_off: Option<HandOffView>,
}

/// A hand-off a rebalance round started ([`ShardCoordinator::rebalance_now`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebalanceStart {
    /// The shard.
    pub shard: ShardId,
    /// Its owner, which hands it off.
    pub from: RegionId,
    /// See [`HandOffView::planned_target`].
    pub planned_target: Option<RegionId>,
}

/// What one rebalance round did ([`ShardCoordinator::rebalance_now`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RebalanceRound {
    /// The hand-offs it started, by shard.
    pub started: Vec<RebalanceStart>,
    /// Why nothing was started when `started` is empty and something
    /// prevented the round (too few Up members, the strategy failed); `None`
    /// when the round ran (an empty `started` then means the strategy found
    /// the regions balanced, or an earlier round is still in progress).
    pub skipped: Option<String>,
    /// Shards still handing off from earlier rounds or shutdowns (count).
    pub in_progress: usize,
}

/// A shard whose hand-off was abandoned after its owner was sent `HandOff`
/// (see `ShardCoordinator::still_stopping`).
#[derive(Debug, Clone)]
struct StillStopping {
    /// The owner, which keeps the shard.
    owner: RegionId,
    /// The abandoned hand-off's generation: the owner's `ShardStopped`
    /// names it when its stop ends.
    generation: Generation,
    /// When the coordinator stops waiting for that report (see
    /// [`STILL_STOPPING_WAIT_TIMEOUTS`]).
    until: Duration,
    /// A hand-off was asked for meanwhile (the owner's region is shutting
    /// down): it starts when the wait ends.
    handoff_wanted: bool,
}

#[derive(Debug, Clone)]
struct HandOffState {
    generation: Generation,
    owner: RegionId,
    waiting_acks: BTreeSet<RegionId>,
    handoff_sent: bool,
    since: Duration,
    deadline: Duration,
    planned_target: Option<RegionId>,
    /// When the unanswered step is sent again ([`HANDOFF_RESEND_INTERVAL`]):
    /// `BeginHandOff` to the regions that have not acknowledged it, or,
    /// once `handoff_sent`, `HandOff` to the owner.
    resend_at: Duration,
}

/// How often the coordinator repeats a hand-off's step that has not been
/// answered (3 s): `BeginHandOff` to every region that has not
/// acknowledged it, then, once all did, `HandOff` to the owner until it
/// reports `ShardStopped`. The links between nodes drop control frames
/// while they reconnect; without a repeat, one lost message would hold the
/// hand-off, and with it every later rebalance round (the default strategy
/// starts none while one is in progress), until `handoff_timeout` abandons
/// it (60 s by default). A region answers a repeat as it answered the
/// first: it acknowledges `BeginHandOff` again (through the owner, behind
/// what it forwarded to it, as before); an owner already stopping the
/// shard ignores `HandOff`, and one that no longer hosts it reports it
/// stopped. The coordinator ignores answers it no longer waits for.
/// (Akka's coordinator sends each step once and relies on its links; ours
/// are allowed to drop.)
///
/// Repeating `HandOff` once let a sender's messages be processed out of
/// order in the simulation's `cluster-leave-timeout` (34 of 200 seeds).
/// A hand-off abandoned while its owner was still stopping the shard
/// names that owner as the home again, so other regions forwarded into
/// its stopping buffer; a second hand-off of the shard started, the
/// repeated `HandOff` drew a `ShardStopped` of the new generation once the
/// shard was gone, and the shard moved with those older messages behind
/// newer ones (see `docs/node.md`). No second hand-off of such a shard
/// starts before the owner reports its stop now
/// (`ShardCoordinator::still_stopping`); with that, the repeat gives 0
/// violations in 2,000 seeds of that scenario.
pub const HANDOFF_RESEND_INTERVAL: Duration = Duration::from_secs(3);

/// How many `handoff_timeout`s the coordinator waits, after abandoning a
/// hand-off whose `HandOff` was sent, for the owner's report that it
/// stopped the shard, before the shard may be handed off again (10: 10
/// minutes by default). The wait ends early with the report; it runs out
/// only if the report was lost (the shard then stays out of rebalance
/// rounds that long, still served by its owner), or if the owner still
/// stops the shard after all that time: a hand-off started then may wait
/// out its timeout, and messages that other regions forwarded into the
/// owner's stopping buffer may reach the next home behind newer ones. A
/// short wait made that second case likelier; a long one only delays the
/// rebalancing of a shard whose report was lost.
pub const STILL_STOPPING_WAIT_TIMEOUTS: u32 = 10;

/// The shard coordinator state machine (one per cluster, on the oldest
/// member).
///
/// Order of calls: construct with [`ShardCoordinator::new`] (fresh) or
/// [`ShardCoordinator::recover`] (from the journal); feed the membership
/// view with [`handle_membership`](Self::handle_membership); then
/// [`handle_message`](Self::handle_message) for every region message and
/// [`handle_timeout`](Self::handle_timeout) when
/// [`poll_timeout`](Self::poll_timeout) has passed; after each call drain
/// [`poll_effect`](Self::poll_effect) until `None`.
pub struct ShardCoordinator {
    settings: CoordinatorSettings,
    strategy: Box<dyn ShardAllocationStrategy + Send>,
    state: CoordinatorState,
    members: BTreeMap<UniqueAddress, MemberStatus>,
    removed: BTreeSet<UniqueAddress>,
    shutting_down: BTreeSet<RegionId>,
    rebalance: BTreeMap<ShardId, HandOffState>,
    deferred: BTreeMap<ShardId, BTreeSet<RegionId>>,
    next_rebalance_at: Duration,
    effects: VecDeque<CoordinatorEffect>,
    strategy_errors: u64,
    /// Hand-offs abandoned since the runtime last took them (bounded: the
    /// oldest are dropped beyond 1,024).
    abandoned: VecDeque<AbandonedHandOff>,
    /// Shards whose hand-off was abandoned after `HandOff` was sent: their
    /// owner may still be stopping them (its entities slower to stop than
    /// `handoff_timeout`), and it ignores another `HandOff` until that
    /// stop ends, then reports the old generation. No new hand-off of such
    /// a shard starts until the owner reported the stop (or
    /// [`STILL_STOPPING_WAIT_TIMEOUTS`] more `handoff_timeout`s passed):
    /// one started earlier would wait out its whole timeout, and every
    /// region's `GetShardHome` for the shard with it.
    still_stopping: BTreeMap<ShardId, StillStopping>,
    /// Recovered regions and proxies that have not registered again yet.
    unconfirmed: BTreeSet<RegionId>,
    reregister_deadline: Duration,
    /// When the next warm batch runs (see
    /// [`CoordinatorSettings::number_of_shards`]); `None`: nothing to do
    /// until a region registers, a member becomes Up or a shard loses its
    /// home.
    warm_at: Option<Duration>,
    /// Warm batches run so far (count).
    warm_batches: u64,
    /// After a member joined a warm cluster: until then, rebalance rounds
    /// follow each other every `warm_settle` while they find shards to
    /// move (each round within the strategy's limits), so the joiner gets
    /// its share of the (mostly still unused) shards in seconds instead of
    /// one round per `rebalance_interval`. Starts once the joiner may host
    /// shards: its first region registered and its member is Up.
    fast_rebalance_until: Option<Duration>,
    /// Members whose first region registered with a warm cluster before
    /// the member was Up (a joiner's regions register as soon as its node
    /// knows where the coordinator runs, which can be before the leader
    /// makes it Up). Their fast rebalance rounds start when they become
    /// Up: a round before that finds nothing to move to them (their
    /// regions may not host shards yet) and would end the window, leaving
    /// them one round per `rebalance_interval`.
    joining: BTreeSet<UniqueAddress>,
}

impl std::fmt::Debug for ShardCoordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardCoordinator")
            .field("state", &self.state)
            .field("rebalance", &self.rebalance.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl ShardCoordinator {
    /// A fresh coordinator with an empty journal.
    pub fn new(
        settings: CoordinatorSettings,
        strategy: Box<dyn ShardAllocationStrategy + Send>,
        now: Duration,
    ) -> Self {
        Self::recover(settings, strategy, std::iter::empty(), now)
    }

    /// A coordinator that takes over from an earlier one: `events` is its
    /// journal, in order. Regions re-register afterwards and report what they
    /// host; see [`CoordinatorMsg::Register`].
    pub fn recover<'a>(
        settings: CoordinatorSettings,
        strategy: Box<dyn ShardAllocationStrategy + Send>,
        events: impl IntoIterator<Item = &'a CoordinatorEvent>,
        now: Duration,
    ) -> Self {
        Self::recover_state(
            settings,
            strategy,
            CoordinatorState::from_events(events),
            now,
        )
    }

    /// A coordinator that takes over `state` (a snapshot of an earlier
    /// coordinator's state, e.g. recovered from a journal). As
    /// [`recover`](Self::recover): the recorded regions must register again
    /// within [`CoordinatorSettings::reregister_timeout`], or they are
    /// terminated and their shards allocated anew.
    pub fn recover_state(
        settings: CoordinatorSettings,
        strategy: Box<dyn ShardAllocationStrategy + Send>,
        mut state: CoordinatorState,
        now: Duration,
    ) -> Self {
        let next_rebalance_at = now + settings.rebalance_interval;
        state.last_generation = state.last_generation.max(settings.min_generation);
        let unconfirmed = state
            .regions
            .keys()
            .chain(state.proxies.iter())
            .cloned()
            .collect();
        let reregister_deadline = now + settings.reregister_timeout;
        let warm_at = (settings.number_of_shards > 0).then_some(now + settings.warm_settle);
        Self {
            settings,
            strategy,
            state,
            members: BTreeMap::new(),
            removed: BTreeSet::new(),
            shutting_down: BTreeSet::new(),
            rebalance: BTreeMap::new(),
            deferred: BTreeMap::new(),
            next_rebalance_at,
            effects: VecDeque::new(),
            strategy_errors: 0,
            abandoned: VecDeque::new(),
            still_stopping: BTreeMap::new(),
            unconfirmed,
            reregister_deadline,
            warm_at,
            warm_batches: 0,
            fast_rebalance_until: None,
            joining: BTreeSet::new(),
        }
    }

    /// How many warm batches ran (count; see
    /// [`CoordinatorSettings::number_of_shards`]).
    pub fn warm_batches(&self) -> u64 {
        self.warm_batches
    }

    /// Recovered regions and proxies that have not registered again yet
    /// (terminated at the re-register deadline).
    pub fn unconfirmed_regions(&self) -> impl Iterator<Item = &RegionId> + '_ {
        self.unconfirmed.iter()
    }

    /// The current durable state.
    pub fn state(&self) -> &CoordinatorState {
        &self.state
    }

    /// The allocation table: every allocated shard with its home, its
    /// generation and its hand-off, if one is in progress, by shard id.
    /// Shards without a home (never asked for, or handed off and not asked
    /// for since) are not in it.
    pub fn allocation(&self) -> Vec<ShardAllocation> {
        self.state
            .shards
            .iter()
            .map(|(s, (region, generation))| ShardAllocation {
                shard: *s,
                region: region.clone(),
                generation: *generation,
                hand_off: self.rebalance.get(s).map(|h| HandOffView {
                    since: h.since,
                    deadline: h.deadline,
                    planned_target: h.planned_target.clone(),
                    phase: if h.handoff_sent {
                        HandOffPhase::Stopping
                    } else {
                        HandOffPhase::WaitingForAcks {
                            pending: h.waiting_acks.len(),
                        }
                    },
                }),
            })
            .collect()
    }

    /// Runs one rebalance round now (an operator's request), as the
    /// rebalance timer would: the strategy picks the shards to move and
    /// their hand-offs start. The next timed round comes one
    /// `rebalance_interval` after this one. Returns what the round started.
    pub fn rebalance_now(&mut self, now: Duration) -> RebalanceRound {
        let round = self.rebalance_round(now);
        self.allocate_unallocated();
        self.warm(now);
        round
    }

    /// Shards whose hand-off is in progress.
    pub fn rebalance_in_progress(&self) -> impl Iterator<Item = ShardId> + '_ {
        self.rebalance.keys().copied()
    }

    /// How many times the allocation strategy erred or panicked (count).
    pub fn strategy_errors(&self) -> u64 {
        self.strategy_errors
    }

    /// The hand-offs abandoned since the last call, oldest first (at most
    /// 1,024 are kept between calls).
    pub fn take_abandoned_hand_offs(&mut self) -> Vec<AbandonedHandOff> {
        self.abandoned.drain(..).collect()
    }

    /// The next effect to carry out, if any.
    pub fn poll_effect(&mut self) -> Option<CoordinatorEffect> {
        self.effects.pop_front()
    }

    /// All pending effects, in order.
    pub fn drain_effects(&mut self) -> impl Iterator<Item = CoordinatorEffect> + '_ {
        self.effects.drain(..)
    }

    /// The earliest time at which [`handle_timeout`](Self::handle_timeout)
    /// must be called.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let d = self
            .rebalance
            .values()
            .map(|h| h.deadline.min(h.resend_at))
            .min();
        let t = match d {
            Some(d) => d.min(self.next_rebalance_at),
            None => self.next_rebalance_at,
        };
        let t = match self.warm_at {
            Some(w) => t.min(w),
            None => t,
        };
        let t = self
            .still_stopping
            .values()
            .map(|w| w.until)
            .fold(t, Duration::min);
        Some(if self.unconfirmed.is_empty() {
            t
        } else {
            t.min(self.reregister_deadline)
        })
    }

    fn persist(&mut self, e: CoordinatorEvent) {
        self.state.apply(&e);
        self.effects.push_back(CoordinatorEffect::Persist(e));
    }

    fn send(&mut self, to: RegionId, msg: RegionMsg) {
        self.effects.push_back(CoordinatorEffect::Send { to, msg });
    }

    fn up_count(&self) -> usize {
        self.members
            .values()
            .filter(|s| **s == MemberStatus::Up)
            .count()
    }

    fn eligible(&self) -> BTreeMap<RegionId, Vec<ShardId>> {
        self.state
            .regions
            .iter()
            .filter(|(r, _)| {
                self.members.get(&r.member) == Some(&MemberStatus::Up)
                    && !self.shutting_down.contains(*r)
            })
            .map(|(r, s)| (r.clone(), s.iter().copied().collect()))
            .collect()
    }

    /// Applies a membership change. A removed member's regions are
    /// terminated: their shards are deallocated (and re-allocated on demand,
    /// or at once with [`CoordinatorSettings::remember_entities`]), and they
    /// count as having acknowledged every hand-off.
    pub fn handle_membership(&mut self, now: Duration, event: MembershipEvent) {
        self.membership_inner(now, event);
        self.allocate_unallocated();
        self.warm(now);
    }

    fn membership_inner(&mut self, now: Duration, event: MembershipEvent) {
        match event {
            MembershipEvent::CurrentMembers(list) => {
                self.members = list.into_iter().collect();
                // Joiners now Up start the fast rounds; those no longer
                // listed (or Leaving) never will.
                let up = self
                    .joining
                    .iter()
                    .any(|m| self.members.get(m) == Some(&MemberStatus::Up));
                let members = &self.members;
                self.joining
                    .retain(|m| members.get(m).is_some_and(|s| *s != MemberStatus::Up));
                if up {
                    self.start_fast_rebalance(now);
                }
                let dead: Vec<RegionId> = self
                    .state
                    .regions
                    .keys()
                    .chain(self.state.proxies.iter())
                    .filter(|r| !self.members.contains_key(&r.member))
                    .cloned()
                    .collect();
                for r in dead {
                    self.terminate_region(now, &r);
                }
            }
            MembershipEvent::MemberUp(m) => {
                if !self.removed.contains(&m) {
                    if self.joining.remove(&m) {
                        // Its regions registered while it was Joining: they
                        // may host shards from now on.
                        self.start_fast_rebalance(now);
                    }
                    self.members.insert(m, MemberStatus::Up);
                    self.warm_later(now);
                }
            }
            MembershipEvent::MemberLeaving(m) => {
                self.joining.remove(&m);
                if let Some(s) = self.members.get_mut(&m) {
                    *s = MemberStatus::Leaving;
                }
            }
            MembershipEvent::MemberRemoved(m) => {
                self.joining.remove(&m);
                self.members.remove(&m);
                let dead: Vec<RegionId> = self
                    .state
                    .regions
                    .keys()
                    .chain(self.state.proxies.iter())
                    .chain(self.rebalance.values().flat_map(|h| h.waiting_acks.iter()))
                    .filter(|r| r.member == m)
                    .cloned()
                    .collect();
                self.removed.insert(m);
                for r in dead {
                    self.terminate_region(now, &r);
                }
            }
            MembershipEvent::RegionTerminated(r) => self.terminate_region(now, &r),
        }
    }

    fn terminate_region(&mut self, now: Duration, r: &RegionId) {
        self.shutting_down.remove(r);
        self.unconfirmed.remove(r);
        let mut freed = Vec::new();
        if let Some(shards) = self.state.regions.get(r).cloned() {
            for s in shards {
                let generation = self.state.shards[&s].1;
                self.persist(CoordinatorEvent::ShardHomeDeallocated {
                    shard: s,
                    generation,
                });
                if self.settings.remember_entities {
                    self.persist(CoordinatorEvent::ShardUnallocated { shard: s });
                }
                self.rebalance.remove(&s);
                self.still_stopping.remove(&s);
                freed.push(s);
            }
            self.persist(CoordinatorEvent::ShardRegionTerminated { region: r.clone() });
        }
        if self.state.proxies.contains(r) {
            self.persist(CoordinatorEvent::ShardRegionProxyTerminated { proxy: r.clone() });
        }
        for d in self.deferred.values_mut() {
            d.remove(r);
        }
        let acked: Vec<ShardId> = self
            .rebalance
            .iter_mut()
            .filter_map(|(s, h)| h.waiting_acks.remove(r).then_some(*s))
            .collect();
        for s in acked {
            self.maybe_send_handoff(now, s);
        }
        for s in freed {
            self.answer_deferred(s);
        }
    }

    /// Handles a message from a region.
    pub fn handle_message(&mut self, now: Duration, msg: CoordinatorMsg) {
        self.message_inner(now, msg);
        self.allocate_unallocated();
        self.warm(now);
    }

    fn message_inner(&mut self, now: Duration, msg: CoordinatorMsg) {
        match msg {
            CoordinatorMsg::Register {
                region,
                hosted,
                stopping,
            } => {
                if self.removed.contains(&region.member) {
                    return;
                }
                let was_unconfirmed = self.unconfirmed.remove(&region);
                if !self.state.regions.contains_key(&region) {
                    let joined = self.settings.number_of_shards > 0
                        && !self.state.shards.is_empty()
                        && !self.state.regions.keys().any(|r| r.member == region.member);
                    if joined {
                        if self.members.get(&region.member) == Some(&MemberStatus::Up) {
                            self.start_fast_rebalance(now);
                        } else {
                            // Not Up yet: its regions may not host shards,
                            // so the fast rounds start when it is Up.
                            self.joining.insert(region.member.clone());
                        }
                    }
                    self.persist(CoordinatorEvent::ShardRegionRegistered {
                        region: region.clone(),
                    });
                }
                self.send(region.clone(), RegionMsg::RegisterAck);
                let stopping: BTreeSet<ShardId> = stopping.into_iter().collect();
                for (s, g) in hosted {
                    let agrees = matches!(self.state.shards.get(&s), Some((r, g2)) if *r == region && *g2 == g);
                    if agrees && stopping.contains(&s) && !self.rebalance.contains_key(&s) {
                        // The owner is stopping the shard after a `HandOff`
                        // of an earlier coordinator: every region acked that
                        // hand-off's `BeginHandOff` and buffers the shard's
                        // messages. Resume it at its last step (wait for
                        // `ShardStopped`); naming the owner as the home
                        // would send other regions' messages into its
                        // stopping buffer, which reaches the new home after
                        // their newer ones ("Ordering" in `region.rs`).
                        self.rebalance.insert(
                            s,
                            HandOffState {
                                generation: g,
                                owner: region.clone(),
                                waiting_acks: BTreeSet::new(),
                                handoff_sent: true,
                                since: now,
                                deadline: now + self.settings.handoff_timeout,
                                planned_target: None,
                                resend_at: now + HANDOFF_RESEND_INTERVAL,
                            },
                        );
                        continue;
                    }
                    if !agrees {
                        // A stale copy: the region must stop it.
                        self.send(
                            region.clone(),
                            RegionMsg::HandOff {
                                shard: s,
                                generation: g,
                            },
                        );
                    }
                }
                let homes: Vec<(ShardId, RegionId, Generation)> =
                    if self.settings.number_of_shards > 0 {
                        // Warm routing: every known home, so the region
                        // routes without asking.
                        self.confirmed_homes()
                    } else {
                        self.state.regions[&region]
                            .iter()
                            .filter(|s| !self.rebalance.contains_key(s))
                            .map(|s| (*s, region.clone(), self.state.shards[s].1))
                            .collect()
                    };
                for chunk in homes.chunks(WARM_HOMES_PER_MESSAGE) {
                    self.send(
                        region.clone(),
                        RegionMsg::ShardHomes {
                            homes: chunk.to_vec(),
                        },
                    );
                }
                if was_unconfirmed {
                    // `GetShardHome`s for its shards waited for this.
                    self.answer_deferred_of(&region);
                    self.push_homes_of(&region);
                }
                self.warm_later(now);
            }
            CoordinatorMsg::RegisterProxy { proxy } => {
                if self.removed.contains(&proxy.member) {
                    return;
                }
                self.unconfirmed.remove(&proxy);
                if !self.state.proxies.contains(&proxy) {
                    self.persist(CoordinatorEvent::ShardRegionProxyRegistered {
                        proxy: proxy.clone(),
                    });
                }
                self.send(proxy.clone(), RegionMsg::RegisterAck);
                if self.settings.number_of_shards > 0 {
                    // Warm routing: a proxy routes without asking too.
                    let homes = self.confirmed_homes();
                    for chunk in homes.chunks(WARM_HOMES_PER_MESSAGE) {
                        self.send(
                            proxy.clone(),
                            RegionMsg::ShardHomes {
                                homes: chunk.to_vec(),
                            },
                        );
                    }
                }
            }
            CoordinatorMsg::GetShardHome { region, shard } => {
                if self.removed.contains(&region.member) {
                    return;
                }
                if self.rebalance.contains_key(&shard) || self.home_unconfirmed(shard) {
                    // A hand-off in progress, or (after a recovery) a home
                    // that has not registered again and may be stopping the
                    // shard: answered once that is settled.
                    self.deferred.entry(shard).or_default().insert(region);
                } else if let Some((home, generation)) = self.state.shards.get(&shard).cloned() {
                    self.send(
                        region,
                        RegionMsg::ShardHome {
                            shard,
                            region: home,
                            generation,
                        },
                    );
                } else {
                    self.deferred.entry(shard).or_default().insert(region);
                    self.answer_deferred(shard);
                }
            }
            CoordinatorMsg::BeginHandOffAck {
                shard,
                generation,
                region,
            } => {
                if let Some(h) = self.rebalance.get_mut(&shard) {
                    if h.generation == generation {
                        h.waiting_acks.remove(&region);
                        self.maybe_send_handoff(now, shard);
                    }
                }
            }
            CoordinatorMsg::ShardStopped {
                shard,
                generation,
                region,
            } => {
                let done = matches!(self.rebalance.get(&shard),
                    Some(h) if h.handoff_sent && h.generation == generation && h.owner == region);
                let late = matches!(self.still_stopping.get(&shard),
                    Some(w) if w.generation == generation && w.owner == region);
                if late {
                    // The owner's stop of an abandoned hand-off ended; it
                    // restarted the shard (it is still its home).
                    self.end_still_stopping(now, shard);
                }
                if done {
                    self.rebalance.remove(&shard);
                    self.persist(CoordinatorEvent::ShardHomeDeallocated { shard, generation });
                    if self.settings.remember_entities {
                        self.persist(CoordinatorEvent::ShardUnallocated { shard });
                    }
                    self.answer_deferred(shard);
                    if self.settings.number_of_shards > 0 {
                        // Warm routing: the moved shard gets its new home
                        // now (the batch of this input), not on demand.
                        self.warm_at = Some(now);
                    }
                }
            }
            CoordinatorMsg::GracefulShutdownReq { region } => {
                if let Some(shards) = self.state.regions.get(&region).cloned() {
                    self.shutting_down.insert(region);
                    for s in shards {
                        if let Some(w) = self.still_stopping.get_mut(&s) {
                            w.handoff_wanted = true;
                        } else if !self.rebalance.contains_key(&s) {
                            self.start_handoff(now, s, None);
                        }
                    }
                }
            }
        }
    }

    fn start_handoff(&mut self, now: Duration, shard: ShardId, planned_target: Option<RegionId>) {
        let Some((owner, generation)) = self.state.shards.get(&shard).cloned() else {
            return;
        };
        let waiting: BTreeSet<RegionId> = self
            .state
            .regions
            .keys()
            .chain(self.state.proxies.iter())
            .filter(|r| !self.removed.contains(&r.member))
            .cloned()
            .collect();
        for r in &waiting {
            self.send(
                r.clone(),
                RegionMsg::BeginHandOff {
                    shard,
                    generation,
                    owner: owner.clone(),
                },
            );
        }
        self.rebalance.insert(
            shard,
            HandOffState {
                generation,
                owner,
                waiting_acks: waiting,
                handoff_sent: false,
                since: now,
                deadline: now + self.settings.handoff_timeout,
                planned_target,
                resend_at: now + HANDOFF_RESEND_INTERVAL,
            },
        );
        self.maybe_send_handoff(now, shard);
    }

    fn maybe_send_handoff(&mut self, now: Duration, shard: ShardId) {
        let Some(h) = self.rebalance.get_mut(&shard) else {
            return;
        };
        if h.waiting_acks.is_empty() && !h.handoff_sent {
            h.handoff_sent = true;
            h.resend_at = now + HANDOFF_RESEND_INTERVAL;
            let (to, generation) = (h.owner.clone(), h.generation);
            self.send(to, RegionMsg::HandOff { shard, generation });
        }
    }

    /// Whether `shard`'s recorded home is a recovered region that has not
    /// registered again yet (its `Register` says whether it is stopping the
    /// shard).
    fn home_unconfirmed(&self, shard: ShardId) -> bool {
        self.state
            .shards
            .get(&shard)
            .is_some_and(|(home, _)| self.unconfirmed.contains(home))
    }

    /// Every home a region may route to without asking: the allocated
    /// shards that are not handing off and whose home is not a recovered
    /// region that has yet to register again (its `Register` may say it is
    /// still stopping them; naming it would send messages into its stopping
    /// buffer, behind which newer ones could reach the next home first).
    fn confirmed_homes(&self) -> Vec<(ShardId, RegionId, Generation)> {
        self.state
            .shards
            .iter()
            .filter(|(s, (r, _))| !self.rebalance.contains_key(s) && !self.unconfirmed.contains(r))
            .map(|(s, (r, g))| (*s, r.clone(), *g))
            .collect()
    }

    /// Warm routing: tells every other registered region and proxy the
    /// homes at `region`, which was a recovered region and is now
    /// confirmed (it registered again, or was kept at the re-register
    /// deadline); [`Self::confirmed_homes`] left them out until then.
    fn push_homes_of(&mut self, region: &RegionId) {
        if self.settings.number_of_shards == 0 {
            return;
        }
        let homes: Vec<(ShardId, RegionId, Generation)> = self
            .state
            .regions
            .get(region)
            .into_iter()
            .flatten()
            .filter(|s| !self.rebalance.contains_key(s))
            .map(|s| (*s, region.clone(), self.state.shards[s].1))
            .collect();
        if homes.is_empty() {
            return;
        }
        let to: Vec<RegionId> = self
            .state
            .regions
            .keys()
            .chain(self.state.proxies.iter())
            .filter(|r| {
                *r != region && !self.removed.contains(&r.member) && !self.unconfirmed.contains(*r)
            })
            .cloned()
            .collect();
        for r in to {
            for chunk in homes.chunks(WARM_HOMES_PER_MESSAGE) {
                self.send(
                    r.clone(),
                    RegionMsg::ShardHomes {
                        homes: chunk.to_vec(),
                    },
                );
            }
        }
    }

    /// Answers the deferred `GetShardHome`s of the shards homed at `region`
    /// (once it registered again, or was kept at the re-register deadline).
    fn answer_deferred_of(&mut self, region: &RegionId) {
        let shards: Vec<ShardId> = self
            .state
            .regions
            .get(region)
            .map(|set| {
                set.iter()
                    .filter(|s| self.deferred.contains_key(s))
                    .copied()
                    .collect()
            })
            .unwrap_or_default();
        for s in shards {
            self.answer_deferred(s);
        }
    }

    /// Allocates `shard` if it has no home and someone waits for it, then
    /// answers everyone waiting. Answers nothing while the shard's hand-off
    /// is in progress or its home has not registered again after a
    /// recovery.
    fn answer_deferred(&mut self, shard: ShardId) {
        if self.rebalance.contains_key(&shard) || self.home_unconfirmed(shard) {
            return;
        }
        let Some(waiting) = self.deferred.get(&shard) else {
            return;
        };
        let Some(requester) = waiting.iter().next().cloned() else {
            self.deferred.remove(&shard);
            return;
        };
        if !self.state.shards.contains_key(&shard) && !self.allocate(shard, &requester) {
            return;
        }
        let (home, generation) = self.state.shards[&shard].clone();
        let waiting = self.deferred.remove(&shard).unwrap_or_default();
        for r in waiting {
            self.send(
                r,
                RegionMsg::ShardHome {
                    shard,
                    region: home.clone(),
                    generation,
                },
            );
        }
    }

    /// Allocates `shard` (which has no home) through the strategy and tells
    /// the new home. Returns false when it cannot be allocated now (too few
    /// Up members, no eligible region, or the strategy failed).
    fn allocate(&mut self, shard: ShardId, requester: &RegionId) -> bool {
        if self.up_count() < self.settings.min_nr_of_members.max(1) {
            return false;
        }
        let current = self.eligible();
        if current.is_empty() {
            return false;
        }
        let chosen = catch_unwind(AssertUnwindSafe(|| {
            self.strategy.allocate_shard(requester, shard, &current)
        }));
        let home = match chosen {
            Ok(Ok(r)) if current.contains_key(&r) => r,
            _ => {
                self.strategy_errors += 1;
                return false;
            }
        };
        let generation = Generation(self.state.last_generation.0 + 1);
        self.persist(CoordinatorEvent::ShardHomeAllocated {
            shard,
            region: home.clone(),
            generation,
        });
        self.send(
            home.clone(),
            RegionMsg::ShardHome {
                shard,
                region: home,
                generation,
            },
        );
        true
    }

    /// With remember entities on, allocates every shard recorded as
    /// unallocated, without waiting for a message (Akka's
    /// `allocateShardHomesForRememberEntities`); the new home starts the
    /// shard on its `ShardHome` and restarts its remembered entities. Shards
    /// that cannot be allocated yet (too few Up members, no registered
    /// region) stay recorded and are tried again after the next input.
    fn allocate_unallocated(&mut self) {
        if !self.settings.remember_entities || self.state.unallocated.is_empty() {
            return;
        }
        let shards: Vec<ShardId> = self
            .state
            .unallocated
            .iter()
            .copied()
            .filter(|s| !self.state.shards.contains_key(s) && !self.rebalance.contains_key(s))
            .collect();
        for s in shards {
            if self.deferred.contains_key(&s) {
                self.answer_deferred(s);
                if self.state.shards.contains_key(&s) {
                    continue;
                }
            }
            // The strategy's requester: the coordinator itself in Akka; here
            // the least-loaded eligible region (strategies allocate by load).
            let Some(requester) = self
                .eligible()
                .into_iter()
                .min_by_key(|(_, shards)| shards.len())
                .map(|(r, _)| r)
            else {
                return;
            };
            if !self.allocate(s, &requester) {
                return;
            }
        }
    }

    /// Pushes the next warm batch back by `warm_settle` (a region
    /// registered or a member became Up: more may follow).
    fn warm_later(&mut self, now: Duration) {
        if self.settings.number_of_shards > 0 {
            self.warm_at = Some(now + self.settings.warm_settle);
        }
    }

    /// Runs the warm batch when it is due (see
    /// [`CoordinatorSettings::number_of_shards`]); arms it when shards
    /// lack a home.
    fn warm(&mut self, now: Duration) {
        let n = self.settings.number_of_shards as usize;
        if n == 0 {
            return;
        }
        if self.state.shards.len() >= n {
            self.warm_at = None;
            return;
        }
        match self.warm_at {
            None => {
                self.warm_at = Some(now + self.settings.warm_settle);
                return;
            }
            Some(t) if now < t => return,
            Some(_) => {}
        }
        if !self.unconfirmed.is_empty() {
            // A recovered coordinator waits for its regions to register
            // again (or for the re-register deadline).
            self.warm_at = Some(now + self.settings.warm_settle);
            return;
        }
        // Tried once; armed again by the next input if shards still lack
        // a home (at most one try per `warm_settle` while no region is
        // eligible).
        self.warm_at = None;
        self.warm_batch();
    }

    /// Allocates every shard of `0..number_of_shards` that has no home
    /// (and is not handing off), one strategy call each against the loads
    /// with the batch's earlier allocations applied, then tells every
    /// registered region and proxy the new homes.
    fn warm_batch(&mut self) {
        if self.up_count() < self.settings.min_nr_of_members.max(1) {
            return;
        }
        let mut current = self.eligible();
        if current.is_empty() {
            return;
        }
        let todo: Vec<ShardId> = (0..self.settings.number_of_shards)
            .map(ShardId)
            .filter(|s| !self.state.shards.contains_key(s) && !self.rebalance.contains_key(s))
            .collect();
        let mut homes: Vec<(ShardId, RegionId, Generation)> = Vec::with_capacity(todo.len());
        for s in todo {
            // The requester: the least-loaded eligible region (there is no
            // asking region; strategies allocate by load).
            let Some(requester) = current
                .iter()
                .min_by_key(|(r, v)| (v.len(), *r))
                .map(|(r, _)| r.clone())
            else {
                break;
            };
            let view = &current;
            let chosen = catch_unwind(AssertUnwindSafe(|| {
                self.strategy.allocate_shard(&requester, s, view)
            }));
            let home = match chosen {
                Ok(Ok(r)) if current.contains_key(&r) => r,
                _ => {
                    self.strategy_errors += 1;
                    break;
                }
            };
            let generation = Generation(self.state.last_generation.0 + 1);
            self.persist(CoordinatorEvent::ShardHomeAllocated {
                shard: s,
                region: home.clone(),
                generation,
            });
            if let Some(v) = current.get_mut(&home) {
                let at = v.binary_search(&s).unwrap_or_else(|i| i);
                v.insert(at, s);
            }
            homes.push((s, home, generation));
        }
        if homes.is_empty() {
            return;
        }
        self.warm_batches += 1;
        let to: Vec<RegionId> = self
            .state
            .regions
            .keys()
            .chain(self.state.proxies.iter())
            .filter(|r| !self.removed.contains(&r.member))
            .cloned()
            .collect();
        for r in to {
            for chunk in homes.chunks(WARM_HOMES_PER_MESSAGE) {
                self.send(
                    r.clone(),
                    RegionMsg::ShardHomes {
                        homes: chunk.to_vec(),
                    },
                );
            }
        }
        // Askers that are not registered regions (or asked before the
        // batch) get their answer too.
        for (s, _, _) in &homes {
            if self.deferred.contains_key(s) {
                self.answer_deferred(*s);
            }
        }
    }

    /// Runs the timers that are due: the re-register deadline of a
    /// recovered coordinator, abandoned hand-offs, and the rebalance round.
    pub fn handle_timeout(&mut self, now: Duration) {
        self.timeout_inner(now);
        self.allocate_unallocated();
        self.warm(now);
    }

    fn timeout_inner(&mut self, now: Duration) {
        if !self.unconfirmed.is_empty() && now >= self.reregister_deadline {
            // Recovered regions that did not register again in time and
            // whose member is not Up are gone: their shards are allocated
            // anew on demand. Regions of Up members stay (see
            // `reregister_timeout`).
            let (kept, gone): (Vec<RegionId>, Vec<RegionId>) =
                std::mem::take(&mut self.unconfirmed)
                    .into_iter()
                    .partition(|r| self.members.get(&r.member) == Some(&MemberStatus::Up));
            for r in gone {
                self.terminate_region(now, &r);
            }
            for r in kept {
                self.answer_deferred_of(&r);
                self.push_homes_of(&r);
            }
        }
        let expired: Vec<ShardId> = self
            .rebalance
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(s, _)| *s)
            .collect();
        for s in expired {
            let h = self.rebalance.remove(&s).expect("present");
            let reason = if h.handoff_sent {
                format!(
                    "the owner did not report ShardStopped within the hand-off timeout ({} ms)",
                    self.settings.handoff_timeout.as_millis()
                )
            } else {
                let missing: Vec<String> = h.waiting_acks.iter().map(|r| r.to_string()).collect();
                // The other regions acknowledge through the owner (behind
                // what they forwarded to it): an owner that does not answer
                // holds their acks too.
                let relayed = if h.waiting_acks.contains(&h.owner) && h.waiting_acks.len() > 1 {
                    format!(
                        "; the other regions' acks are relayed by the owner {}, which has not acknowledged",
                        h.owner
                    )
                } else {
                    String::new()
                };
                format!(
                    "no BeginHandOffAck within the hand-off timeout ({} ms) from {}{relayed}",
                    self.settings.handoff_timeout.as_millis(),
                    missing.join(", ")
                )
            };
            if self.abandoned.len() >= 1024 {
                self.abandoned.pop_front();
            }
            self.abandoned.push_back(AbandonedHandOff {
                shard: s,
                owner: h.owner.clone(),
                generation: h.generation,
                reason,
            });
            // Abandon: the shard keeps its owner, under a new generation so
            // that a late ShardStopped or ack of this round changes nothing.
            if self.state.shards.get(&s).map(|(r, _)| r) == Some(&h.owner) {
                if h.handoff_sent {
                    self.still_stopping.insert(
                        s,
                        StillStopping {
                            owner: h.owner.clone(),
                            generation: h.generation,
                            until: now
                                + self.settings.handoff_timeout * STILL_STOPPING_WAIT_TIMEOUTS,
                            handoff_wanted: self.shutting_down.contains(&h.owner),
                        },
                    );
                }
                let generation = Generation(self.state.last_generation.0 + 1);
                self.persist(CoordinatorEvent::ShardHomeAllocated {
                    shard: s,
                    region: h.owner.clone(),
                    generation,
                });
                self.send(
                    h.owner.clone(),
                    RegionMsg::ShardHome {
                        shard: s,
                        region: h.owner.clone(),
                        generation,
                    },
                );
            }
            self.answer_deferred(s);
        }
        let waited: Vec<ShardId> = self
            .still_stopping
            .iter()
            .filter(|(_, w)| w.until <= now)
            .map(|(s, _)| *s)
            .collect();
        for s in waited {
            self.end_still_stopping(now, s);
        }
        self.resend_hand_off_steps(now);
        if now >= self.next_rebalance_at {
            let _ = self.rebalance_round(now);
        }
    }

    /// Ends the wait for `shard`'s still-stopping owner (see
    /// `still_stopping`), starting the hand-off a shutdown asked for
    /// meanwhile.
    fn end_still_stopping(&mut self, now: Duration, shard: ShardId) {
        let Some(w) = self.still_stopping.remove(&shard) else {
            return;
        };
        if w.handoff_wanted && !self.rebalance.contains_key(&shard) {
            self.start_handoff(now, shard, None);
        }
    }

    /// Sends the unanswered step of every hand-off whose
    /// [`HANDOFF_RESEND_INTERVAL`] passed again: `BeginHandOff` to the
    /// regions that have not acknowledged it, or `HandOff` to the owner.
    fn resend_hand_off_steps(&mut self, now: Duration) {
        let mut sends = Vec::new();
        for (s, h) in self.rebalance.iter_mut() {
            if h.resend_at > now {
                continue;
            }
            h.resend_at = now + HANDOFF_RESEND_INTERVAL;
            if h.handoff_sent {
                sends.push((
                    h.owner.clone(),
                    RegionMsg::HandOff {
                        shard: *s,
                        generation: h.generation,
                    },
                ));
                continue;
            }
            for r in &h.waiting_acks {
                sends.push((
                    r.clone(),
                    RegionMsg::BeginHandOff {
                        shard: *s,
                        generation: h.generation,
                        owner: h.owner.clone(),
                    },
                ));
            }
        }
        for (to, msg) in sends {
            self.send(to, msg);
        }
    }

    /// One rebalance round: the strategy picks shards, their hand-offs
    /// start, each with the target the strategy would pick for it now.
    fn rebalance_round(&mut self, now: Duration) -> RebalanceRound {
        self.next_rebalance_at = now + self.settings.rebalance_interval;
        let mut round = RebalanceRound::default();
        let needed = self.settings.min_nr_of_members.max(1);
        if self.up_count() < needed {
            round.skipped = Some(format!(
                "{} Up members, {needed} needed before shards are allocated",
                self.up_count()
            ));
            round.in_progress = self.rebalance.len();
            return round;
        }
        let current = self.eligible();
        let in_progress: BTreeSet<ShardId> = self
            .rebalance
            .keys()
            .chain(self.still_stopping.keys())
            .copied()
            .collect();
        let chosen = catch_unwind(AssertUnwindSafe(|| {
            self.strategy.rebalance(&current, &in_progress)
        }));
        match chosen {
            Ok(Ok(shards)) => {
                let mut planned = current;
                for s in shards {
                    let Some((owner, _)) = self.state.shards.get(&s).cloned() else {
                        continue;
                    };
                    if self.rebalance.contains_key(&s) || self.still_stopping.contains_key(&s) {
                        continue;
                    }
                    let target = self.plan_target(&mut planned, &owner, s);
                    self.start_handoff(now, s, target.clone());
                    round.started.push(RebalanceStart {
                        shard: s,
                        from: owner,
                        planned_target: target,
                    });
                }
            }
            Ok(Err(e)) => {
                self.strategy_errors += 1;
                round.skipped = Some(e.to_string());
            }
            Err(_) => {
                self.strategy_errors += 1;
                round.skipped = Some("the allocation strategy panicked".into());
            }
        }
        round.in_progress = self.rebalance.len();
        if let Some(until) = self.fast_rebalance_until {
            if now < until && (!round.started.is_empty() || round.in_progress > 0) {
                self.next_rebalance_at = now + self.settings.warm_settle;
            } else {
                self.fast_rebalance_until = None;
            }
        }
        round
    }

    /// A member joined a warm cluster and may host shards now: rebalance at
    /// once (after `warm_settle`, so that the regions of its other cores
    /// register too) and round after round while shards move, for one
    /// `rebalance_interval` (see `fast_rebalance_until`).
    fn start_fast_rebalance(&mut self, now: Duration) {
        self.fast_rebalance_until = Some(now + self.settings.rebalance_interval);
        self.next_rebalance_at = self.next_rebalance_at.min(now + self.settings.warm_settle);
    }

    /// The region the strategy would allocate `shard` to once it left
    /// `owner`, in `planned` (the loads with the round's earlier moves
    /// applied, updated with this one). `None` when the strategy errs,
    /// panics or names no eligible region (not counted as a strategy
    /// error: nothing depends on the plan).
    fn plan_target(
        &mut self,
        planned: &mut BTreeMap<RegionId, Vec<ShardId>>,
        owner: &RegionId,
        shard: ShardId,
    ) -> Option<RegionId> {
        if let Some(v) = planned.get_mut(owner) {
            v.retain(|x| *x != shard);
        }
        let view: &BTreeMap<RegionId, Vec<ShardId>> = planned;
        let chosen = catch_unwind(AssertUnwindSafe(|| {
            self.strategy.allocate_shard(owner, shard, view)
        }));
        match chosen {
            Ok(Ok(r)) if planned.contains_key(&r) => {
                if let Some(v) = planned.get_mut(&r) {
                    v.push(shard);
                    v.sort();
                }
                Some(r)
            }
            _ => None,
        }
    }
}
