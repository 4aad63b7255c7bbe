//! The ShardRegion (one per data core) and the shards it hosts.
//!
//! After Akka's `ShardRegion` and `Shard` (Akka Cluster Sharding docs,
//! "Shard location", "Passivation", "Remembering Entities"):
//! - a cache of shard homes; an unknown home means: buffer (bounded), ask the
//!   coordinator, then deliver or forward;
//! - on `BeginHandOff`: stop routing to that shard, buffer, acknowledge
//!   through the owner (FIFO links then guarantee that the owner has every
//!   message forwarded to it before it is told to hand off);
//! - on `HandOff` (owner): stop each entity after the messages already queued
//!   for it, then send `ShardStopped`;
//! - passivation: `Passivate`, idle timeout, active-entity limit with a
//!   [`ReplacementPolicy`];
//! - remember entities: `EntityStarted`/`EntityStopped` events, restarted when
//!   the shard starts (all at once or at a constant pace).
//!
//! # Ordering
//!
//! Messages from one sender that enter through one region R, to one entity,
//! are processed in the order R received them, also while the entity's
//! shard moves (rebalance, graceful leave) and while the entity passivates.
//! A message of a shard can reach its home by several routes — forwarded by
//! R while R knows the home, held by the old home during the hand-off,
//! buffered by R (or by the new home itself) until `ShardHome`, or sent
//! directly after it — and this rule orders them:
//!
//! 1. While R knows the home H it forwards to H. On `BeginHandOff` it stops
//!    forwarding, buffers, and sends its `BeginHandOffAck` through H, behind
//!    what it forwarded; the coordinator sends `HandOff` only after every
//!    ack. So H has received every message R forwarded before `HandOff`.
//! 2. Everything that reached H before `HandOff` is processed at H before
//!    the shard stops: each entity's stop message is queued after its
//!    mailbox; messages waiting for a passivating entity go to a new
//!    incarnation that is stopped right after them; messages waiting for a
//!    shard that recovers its remembered entities are delivered once it has
//!    recovered, and only then does the shard stop. H never sends any of
//!    these on to the new home.
//! 3. What H holds when it reports `ShardStopped` arrived after `HandOff`,
//!    so it came from H's own senders (the others buffer since
//!    `BeginHandOff`), each of whose earlier messages H has processed.
//! 4. The new home N is allocated only after `ShardStopped`. Every region,
//!    N and H included, flushes its buffer for the shard in arrival order
//!    when it learns the home, then sends directly, behind the flushed
//!    messages on the same link.
//! 5. When the coordinator moves during the hand-off, the new one recovers
//!    the allocation (H) but not the hand-off. It answers no `GetShardHome`
//!    for a shard whose recorded home has not registered again, and H's
//!    `Register` names the shards it is stopping, so the hand-off resumes
//!    (waiting for `ShardStopped`): no region is told that H is the home and
//!    forwards into H's stopping buffer, which would reach N after that
//!    region's newer messages (simulation scenario
//!    `cluster-leave-coordinator-timeout`).
//!
//! So every message a sender sent before its region's `BeginHandOff` is
//! processed at H before N processes anything of the shard, and the later
//! ones reach N in order through one region. This needs each link between
//! two regions to be FIFO for user messages and control messages together
//! (as the simulation models it). It gives no order between different
//! senders, nor for one sender whose messages enter through different
//! regions. A message that fails (buffer full, region shutting down, lost
//! with a crashed or downed node) leaves a gap; the messages after it are
//! still processed in order.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::det::{DetHashMap, DetHashSet};

use super::passivation::{PassivationSettings, ReplacementPolicy};
use super::{
    CoordinatorMsg, EntityKey, Envelope, FailureReason, Generation, MembershipEvent, RegionMsg,
};
use crate::ids::{EntityId, RegionId, ShardId};

/// How remembered entities are restarted when their shard starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RememberEntitiesPace {
    /// All at once (default).
    AllAtOnce,
    /// At most `per_interval` entities (count) every `interval`.
    Constant {
        /// Entities started per interval (count, at least 1).
        per_interval: usize,
        /// The interval.
        interval: Duration,
    },
}

/// Region settings (Akka's `akka.cluster.sharding` keys of the same meaning).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionSettings {
    /// Most messages buffered in the region (count), waiting for a shard
    /// home, a hand-off or a passivation. Default 100,000.
    pub buffer_size: usize,
    /// Retry interval of `Register` and `GetShardHome` (Akka's
    /// `retry-interval`). Default 2 s.
    pub retry_interval: Duration,
    /// Passivation settings.
    pub passivation: PassivationSettings,
    /// Whether to emit `EntityStarted`/`EntityStopped` and restart
    /// remembered entities when a shard starts. Default false.
    pub remember_entities: bool,
    /// How remembered entities are restarted. Default all at once.
    pub remember_entities_pace: RememberEntitiesPace,
}

impl Default for RegionSettings {
    fn default() -> Self {
        Self {
            buffer_size: 100_000,
            retry_interval: Duration::from_secs(2),
            passivation: PassivationSettings::default(),
            remember_entities: false,
            remember_entities_pace: RememberEntitiesPace::AllAtOnce,
        }
    }
}

/// Why an entity is being stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// The entity asked (`Passivate`).
    Passivate,
    /// No message for `idle_timeout`.
    IdleTimeout,
    /// The active-entity limit was reached and the policy chose it.
    ActiveEntityLimit,
    /// Its shard is handed off.
    HandOff,
}

/// A persisted shard event (remember entities).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardEvent {
    /// The entity was started.
    EntityStarted {
        /// Its shard.
        shard: ShardId,
        /// The entity.
        entity: EntityId,
    },
    /// The entity passivated itself for good.
    EntityStopped {
        /// Its shard.
        shard: ShardId,
        /// The entity.
        entity: EntityId,
    },
}

/// An effect for the runtime to carry out, in order.
#[must_use]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegionEffect<M, S> {
    /// Send to the current coordinator (dropped by the runtime when there is
    /// none; the region retries).
    SendToCoordinator(CoordinatorMsg),
    /// Send a control message to another region.
    SendToRegion {
        /// Destination.
        to: RegionId,
        /// The message.
        msg: RegionMsg,
    },
    /// Forward a user message to its home region (which calls
    /// [`ShardRegion::handle_message`] with it).
    Forward {
        /// Destination.
        to: RegionId,
        /// The message.
        envelope: Envelope<M, S>,
    },
    /// Enqueue the message in the local entity's mailbox, creating the entity
    /// first when `new_incarnation` is true.
    Deliver {
        /// The message.
        envelope: Envelope<M, S>,
        /// The entity must be created before the message is enqueued.
        new_incarnation: bool,
    },
    /// A passive message (see [`ShardRegion::set_passive_filter`]) reached
    /// the home region of its entity while that entity was not active (never
    /// started, stopped, or stopping): it is handed back instead of
    /// creating an incarnation.
    NotActive {
        /// The message.
        envelope: Envelope<M, S>,
    },
    /// Create the local entity without a message (remember entities,
    /// `StartEntity`).
    StartEntity {
        /// Its shard.
        shard: ShardId,
        /// The entity.
        entity: EntityId,
    },
    /// Enqueue the stop message after the messages already queued for the
    /// entity; once it is processed and the entity is gone, call
    /// [`ShardRegion::handle_entity_stopped`].
    StopEntity {
        /// Its shard.
        shard: ShardId,
        /// The entity.
        entity: EntityId,
        /// The entity's own stop message (from `Passivate`), or `None` for the
        /// entity type's configured stop message.
        stop_message: Option<M>,
        /// Why.
        reason: StopReason,
    },
    /// Append a remember-entities event to the shard's journal.
    Persist(ShardEvent),
    /// Read the shard's remembered entities and call
    /// [`ShardRegion::handle_remembered_entities`] (messages wait meanwhile).
    RecoverRememberedEntities {
        /// The shard.
        shard: ShardId,
    },
    /// Give the message back to its sender with a failure.
    Fail {
        /// The message.
        envelope: Envelope<M, S>,
        /// Why.
        reason: FailureReason,
    },
}

/// `GetShardRegionState` answer: the shards and entity ids hosted here.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardRegionState {
    /// Shard → ids of its live entities (active or stopping).
    pub shards: BTreeMap<ShardId, BTreeSet<EntityId>>,
}

/// One region's part of `GetClusterShardingStats`: entity count per shard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardRegionStats {
    /// Shard → number of live entities (count).
    pub shards: BTreeMap<ShardId, usize>,
}

/// `GetClusterShardingStats` answer: the stats of every region.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterShardingStats {
    /// Region → its stats.
    pub regions: BTreeMap<RegionId, ShardRegionStats>,
}

impl ClusterShardingStats {
    /// Collects the stats of the given regions (the runtime asks each region
    /// for [`ShardRegion::shard_region_stats`]).
    pub fn from_regions(regions: impl IntoIterator<Item = (RegionId, ShardRegionStats)>) -> Self {
        Self {
            regions: regions.into_iter().collect(),
        }
    }
}

/// The region's state of a live entity, in 8 bytes: while it is active,
/// when it last got a message (ns of the region's clock); once a stop was
/// requested, [`Entity::PASSIVATING`], and its new messages wait in its
/// shard's `passivating` buffers until it has stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entity(u64);

impl Entity {
    /// Stop requested.
    const PASSIVATING: Entity = Entity(u64::MAX);

    /// Active, last messaged at `now` (584 years of ns fit below the
    /// marker).
    fn active(now: Duration) -> Self {
        Entity(now.as_nanos().min(u128::from(Self::PASSIVATING.0 - 1)) as u64)
    }

    /// When an active entity last got a message; `None` while it stops.
    fn last_message_at(self) -> Option<Duration> {
        self.is_active().then(|| Duration::from_nanos(self.0))
    }

    fn is_active(self) -> bool {
        self != Self::PASSIVATING
    }
}

// What a region keeps per live entity beside its id and the host's slot:
// 8 bytes (a table entry of the data plane is then 64: id, state, slot).
const _: () = assert!(std::mem::size_of::<Entity>() == 8);

/// A live entity in its shard's table: the region's state of it and the
/// host's slot `H` ([`ShardRegion::host_slot_mut`]), so that the runtime
/// that runs the entity keeps its object in the same table entry, under
/// the same key, as the region's state: one id stored and one lookup per
/// message. `H` is created with `H::default()` when the entity becomes
/// live here and dropped when the region learns it stopped
/// ([`ShardRegion::handle_entity_stopped`]).
#[derive(Debug)]
struct Slot<H> {
    state: Entity,
    host: H,
}

#[derive(Debug)]
enum ShardState<M, S> {
    /// Waiting for remembered entities; messages wait in `pending`.
    Recovering {
        pending: VecDeque<Envelope<M, S>>,
        /// A `HandOff` (of this generation) came meanwhile: once recovered,
        /// `pending` is delivered here and then the shard stops.
        hand_off: Option<Generation>,
    },
    Running,
    /// Handing off: entities are stopping; nothing new goes in.
    Stopping,
}

#[derive(Debug)]
struct Shard<M, S, H> {
    generation: Generation,
    state: ShardState<M, S>,
    entities: DetHashMap<EntityId, Slot<H>>,
    /// The messages that came for each entity of `entities` that is
    /// stopping ([`Entity::PASSIVATING`]), in order; they start its next
    /// incarnation once it stopped.
    passivating: DetHashMap<EntityId, VecDeque<Envelope<M, S>>>,
}

impl<M, S, H> Shard<M, S, H> {
    /// Whether the shard got its `HandOff`: it is stopping its entities,
    /// or it stops once its remembered entities are recovered.
    fn is_handing_off(&self) -> bool {
        matches!(
            self.state,
            ShardState::Stopping
                | ShardState::Recovering {
                    hand_off: Some(_),
                    ..
                }
        )
    }
}

/// The region state machine: routes messages of one entity type on one core
/// and hosts shards.
///
/// Order of calls: construct with [`ShardRegion::new`] or
/// [`ShardRegion::new_proxy`] (which queue a `Register`); then feed
/// [`handle_message`](Self::handle_message) (user messages from local
/// senders or forwarded by other regions),
/// [`handle_region_msg`](Self::handle_region_msg) (control messages),
/// [`handle_entity_stopped`](Self::handle_entity_stopped),
/// [`handle_passivate`](Self::handle_passivate),
/// [`handle_membership`](Self::handle_membership),
/// [`handle_coordinator_moved`](Self::handle_coordinator_moved), and
/// [`handle_timeout`](Self::handle_timeout) once
/// [`poll_timeout`](Self::poll_timeout) has passed; after each call drain
/// [`poll_effect`](Self::poll_effect) until `None`.
pub struct ShardRegion<M, S, H = ()> {
    id: RegionId,
    settings: RegionSettings,
    proxy: bool,
    registered: bool,
    shutting_down: bool,
    homes: DetHashMap<ShardId, (RegionId, Generation)>,
    floors: DetHashMap<ShardId, Generation>,
    buffers: DetHashMap<ShardId, VecDeque<Envelope<M, S>>>,
    pending_start: DetHashMap<ShardId, Vec<EntityId>>,
    buffered_total: usize,
    shards: DetHashMap<ShardId, Shard<M, S, H>>,
    policy: Box<dyn ReplacementPolicy + Send>,
    active_count: usize,
    dead_letters: u64,
    dead_letters_by_reason: [u64; FailureReason::ALL.len()],
    hand_offs_begun: u64,
    hand_offs_completed: u64,
    dead_regions: DetHashSet<RegionId>,
    next_retry_at: Duration,
    /// The wait before the next `Register` while unregistered: from
    /// [`Self::register_backoff_start`], doubled per attempt up to
    /// `retry_interval` (Akka's region does the same), so a region that
    /// registered while the coordinator was still starting (its first
    /// `Register` lost) is registered a fraction of the interval later.
    register_delay: Duration,
    next_idle_check_at: Option<Duration>,
    paced_starts: VecDeque<EntityKey>,
    next_paced_start_at: Option<Duration>,
    /// The earliest [`Envelope::deadline`] of a buffered message (a lower
    /// bound: it may belong to a message that left the buffer since).
    next_deadline_at: Option<Duration>,
    effects: VecDeque<RegionEffect<M, S>>,
    passive: Option<PassiveFilter<M, S>>,
    on_buffer: Option<fn(&mut M)>,
}

/// Says whether a message is passive ([`ShardRegion::set_passive_filter`]).
pub type PassiveFilter<M, S> = fn(&Envelope<M, S>) -> bool;

impl<M, S, H> std::fmt::Debug for ShardRegion<M, S, H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardRegion")
            .field("id", &self.id)
            .field("proxy", &self.proxy)
            .field("registered", &self.registered)
            .field("hosted", &self.shards.len())
            .field("buffered_total", &self.buffered_total)
            .finish_non_exhaustive()
    }
}

impl<M, S, H: Default> ShardRegion<M, S, H> {
    /// A region that hosts shards; queues its `Register`.
    pub fn new(
        id: RegionId,
        settings: RegionSettings,
        policy: Box<dyn ReplacementPolicy + Send>,
        now: Duration,
    ) -> Self {
        Self::build(id, settings, policy, false, now)
    }

    /// A proxy: routes, hosts nothing; queues its `RegisterProxy`.
    pub fn new_proxy(id: RegionId, settings: RegionSettings, now: Duration) -> Self {
        Self::build(
            id,
            settings,
            Box::new(super::passivation::LruPolicy::new()),
            true,
            now,
        )
    }

    fn build(
        id: RegionId,
        settings: RegionSettings,
        policy: Box<dyn ReplacementPolicy + Send>,
        proxy: bool,
        now: Duration,
    ) -> Self {
        let next_idle_check_at = settings.passivation.idle_timeout.map(|t| now + t / 2);
        let mut r = Self {
            id,
            next_retry_at: Self::register_backoff_start(&settings, now).0,
            register_delay: Self::register_backoff_start(&settings, now).1,
            settings,
            proxy,
            registered: false,
            shutting_down: false,
            homes: DetHashMap::default(),
            floors: DetHashMap::default(),
            buffers: DetHashMap::default(),
            pending_start: DetHashMap::default(),
            buffered_total: 0,
            shards: DetHashMap::default(),
            policy,
            active_count: 0,
            dead_letters: 0,
            dead_letters_by_reason: [0; FailureReason::ALL.len()],
            hand_offs_begun: 0,
            hand_offs_completed: 0,
            dead_regions: DetHashSet::default(),
            next_idle_check_at: if proxy { None } else { next_idle_check_at },
            paced_starts: VecDeque::new(),
            next_paced_start_at: None,
            next_deadline_at: None,
            effects: VecDeque::new(),
            passive: None,
            on_buffer: None,
        };
        r.send_register();
        r
    }

    /// This region's id.
    pub fn id(&self) -> &RegionId {
        &self.id
    }

    /// How many shards' homes this region has cached (count): a region
    /// whose count equals the type's `number_of_shards` routes every
    /// message without asking the coordinator (warm routing, see
    /// `CoordinatorSettings::number_of_shards`).
    pub fn known_homes(&self) -> usize {
        self.homes.len()
    }

    /// The regions that are home to at least one shard in this region's
    /// cache, each once, in no particular order (may include this region).
    /// A node opens its data lanes to them before it serves, so the first
    /// forward to each does not wait for a connection.
    pub fn home_regions(&self) -> Vec<RegionId> {
        let mut out: Vec<RegionId> = Vec::new();
        for (r, _) in self.homes.values() {
            if !out.contains(r) {
                out.push(r.clone());
            }
        }
        out
    }

    /// Whether this region is a proxy.
    pub fn is_proxy(&self) -> bool {
        self.proxy
    }

    /// Whether the current coordinator acknowledged the registration.
    pub fn is_registered(&self) -> bool {
        self.registered
    }

    /// Messages refused with a failure so far (count).
    pub fn dead_letters(&self) -> u64 {
        self.dead_letters
    }

    /// Messages refused so far, by reason (counts, in the order of
    /// [`FailureReason::ALL`]; they sum to [`Self::dead_letters`]).
    pub fn dead_letters_by_reason(&self) -> [(FailureReason, u64); FailureReason::ALL.len()] {
        let mut out = [(FailureReason::BufferFull, 0); FailureReason::ALL.len()];
        for (slot, r) in out.iter_mut().zip(FailureReason::ALL) {
            *slot = (r, self.dead_letters_by_reason[r.index()]);
        }
        out
    }

    /// Hand-offs begun here: shards told to stop by the coordinator's
    /// `HandOff` that started stopping their entities (count).
    pub fn hand_offs_begun(&self) -> u64 {
        self.hand_offs_begun
    }

    /// Hand-offs completed here: shards stopped after a `HandOff` and
    /// reported to the coordinator with `ShardStopped` (count).
    pub fn hand_offs_completed(&self) -> u64 {
        self.hand_offs_completed
    }

    /// Messages waiting in this region's buffers (count).
    pub fn buffered(&self) -> usize {
        self.buffered_total
    }

    /// Active (not stopping) entities (count).
    pub fn active_entities(&self) -> usize {
        self.active_count
    }

    /// The cached home of a shard.
    pub fn home_of(&self, shard: ShardId) -> Option<&(RegionId, Generation)> {
        self.homes.get(&shard)
    }

    /// The shards hosted here: (shard, generation, stopping).
    pub fn hosted_shards(&self) -> impl Iterator<Item = (ShardId, Generation, bool)> + '_ {
        self.shards
            .iter()
            .map(|(s, sh)| (*s, sh.generation, matches!(sh.state, ShardState::Stopping)))
    }

    /// The allocation generation of `shard` while it is hosted here and
    /// waits for its remembered entities (after
    /// [`RegionEffect::RecoverRememberedEntities`], until
    /// [`Self::handle_remembered_entities`]); `None` otherwise.
    pub fn recovering_generation(&self, shard: ShardId) -> Option<Generation> {
        self.shards
            .get(&shard)
            .filter(|sh| matches!(sh.state, ShardState::Recovering { .. }))
            .map(|sh| sh.generation)
    }

    /// `GetShardRegionState`: the shards and entity ids hosted here.
    pub fn shard_region_state(&self) -> ShardRegionState {
        ShardRegionState {
            shards: self
                .shards
                .iter()
                .map(|(s, sh)| (*s, sh.entities.keys().cloned().collect()))
                .collect(),
        }
    }

    /// This region's part of `GetClusterShardingStats`.
    pub fn shard_region_stats(&self) -> ShardRegionStats {
        ShardRegionStats {
            shards: self
                .shards
                .iter()
                .map(|(s, sh)| (*s, sh.entities.len()))
                .collect(),
        }
    }

    /// Whether a graceful shutdown finished: no shard hosted, nothing buffered.
    pub fn is_shutdown_complete(&self) -> bool {
        self.shutting_down && self.shards.is_empty() && self.buffered_total == 0
    }

    /// The next effect to carry out, if any.
    pub fn poll_effect(&mut self) -> Option<RegionEffect<M, S>> {
        self.effects.pop_front()
    }

    /// All pending effects, in order.
    pub fn drain_effects(&mut self) -> impl Iterator<Item = RegionEffect<M, S>> + '_ {
        self.effects.drain(..)
    }

    /// The earliest time at which [`handle_timeout`](Self::handle_timeout)
    /// must be called.
    pub fn poll_timeout(&self) -> Option<Duration> {
        [
            Some(self.next_retry_at),
            self.next_idle_check_at,
            self.next_paced_start_at,
            self.next_deadline_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    fn send_register(&mut self) {
        let msg = if self.proxy {
            CoordinatorMsg::RegisterProxy {
                proxy: self.id.clone(),
            }
        } else {
            let mut stopping: Vec<ShardId> = self
                .shards
                .iter()
                .filter(|(_, sh)| sh.is_handing_off())
                .map(|(s, _)| *s)
                .collect();
            stopping.sort();
            CoordinatorMsg::Register {
                region: self.id.clone(),
                hosted: self
                    .shards
                    .iter()
                    .map(|(s, sh)| (*s, sh.generation))
                    .collect(),
                stopping,
            }
        };
        self.effects.push_back(RegionEffect::SendToCoordinator(msg));
    }

    fn ask_home(&mut self, shard: ShardId) {
        if self.registered {
            self.effects.push_back(RegionEffect::SendToCoordinator(
                CoordinatorMsg::GetShardHome {
                    region: self.id.clone(),
                    shard,
                },
            ));
        }
    }

    /// The coordinator moved (or this region must register again): drops the
    /// registration and queues a new `Register` reporting the hosted shards.
    pub fn handle_coordinator_moved(&mut self, now: Duration) {
        self.registered = false;
        self.send_register();
        (self.next_retry_at, self.register_delay) =
            Self::register_backoff_start(&self.settings, now);
    }

    /// Right after a `Register` sent at `now`: when to send the next one
    /// and the wait after that. The first wait is `retry_interval / 8`, at
    /// least 100 ms (Akka's `initRegistrationDelay`), at most
    /// `retry_interval`; each later one doubles, up to `retry_interval`.
    fn register_backoff_start(settings: &RegionSettings, now: Duration) -> (Duration, Duration) {
        let first = (settings.retry_interval / 8)
            .max(Duration::from_millis(100))
            .min(settings.retry_interval);
        (now + first, (first * 2).min(settings.retry_interval))
    }

    /// Starts a graceful shutdown (Akka's `GracefulShutdown`): asks the
    /// coordinator to hand off every shard hosted here. Complete when
    /// [`is_shutdown_complete`](Self::is_shutdown_complete).
    pub fn start_graceful_shutdown(&mut self, now: Duration) {
        let _ = now;
        self.shutting_down = true;
        if self.registered {
            self.effects.push_back(RegionEffect::SendToCoordinator(
                CoordinatorMsg::GracefulShutdownReq {
                    region: self.id.clone(),
                },
            ));
        }
    }

    /// Declares which messages are passive: system messages (lifecycle
    /// watches, `Terminated` notices) that are routed exactly like user
    /// messages (buffered, forwarded, handed off) but at the home region are
    /// delivered only to an active entity. A passive message never creates
    /// an entity, never refreshes its idle timer or its place in the
    /// replacement policy, and comes back as [`RegionEffect::NotActive`]
    /// when the entity is not active. Default: no message is passive.
    pub fn set_passive_filter(&mut self, is_passive: PassiveFilter<M, S>) {
        self.passive = Some(is_passive);
    }

    /// Sets a function called on a message when the region buffers it
    /// (shard without a known home, shard recovering or handing off,
    /// entity passivating), before it is kept. The node uses it to give a
    /// buffered payload its own bytes, so that a message waiting in a
    /// buffer does not keep its connection's whole receive buffer alive.
    /// Default: none.
    pub fn set_buffer_hook(&mut self, on_buffer: fn(&mut M)) {
        self.on_buffer = Some(on_buffer);
    }

    /// Runs the buffer hook `on_buffer` (see [`Self::set_buffer_hook`]) on
    /// a message about to be buffered. (Takes the hook, not `self`: two
    /// callers hold a shard's buffer borrowed.)
    fn detach(on_buffer: Option<fn(&mut M)>, envelope: &mut Envelope<M, S>) {
        if let Some(f) = on_buffer {
            f(&mut envelope.payload);
        }
    }

    /// A user message, from a local sender or forwarded by another region.
    /// Delivered, forwarded, buffered, or handed back with
    /// [`RegionEffect::Fail`] when the buffer is full.
    pub fn handle_message(&mut self, now: Duration, envelope: Envelope<M, S>) {
        self.route(now, envelope);
    }

    fn route(&mut self, now: Duration, envelope: Envelope<M, S>) {
        if envelope.deadline.is_some_and(|d| now >= d) {
            // The sender stopped waiting: never deliver it later.
            return self.fail(envelope, FailureReason::DeadlinePassed);
        }
        let s = envelope.shard;
        if let Some(shard) = self.shards.get_mut(&s) {
            match &mut shard.state {
                ShardState::Running => return self.deliver_local(now, envelope),
                ShardState::Recovering { pending, .. } => {
                    if self.buffered_total >= self.settings.buffer_size {
                        return self.fail(envelope, FailureReason::BufferFull);
                    }
                    self.buffered_total += 1;
                    let d = envelope.deadline;
                    let mut envelope = envelope;
                    Self::detach(self.on_buffer, &mut envelope);
                    pending.push_back(envelope);
                    self.note_deadline(d);
                    return;
                }
                ShardState::Stopping => return self.buffer(envelope),
            }
        }
        match self.homes.get(&s) {
            Some((home, g)) if *home == self.id => {
                if self.proxy {
                    return self.fail(envelope, FailureReason::NotHosted);
                }
                let g = *g;
                self.start_shard(s, g);
                self.route(now, envelope);
            }
            Some((home, _)) => {
                let to = home.clone();
                self.effects
                    .push_back(RegionEffect::Forward { to, envelope });
            }
            None => self.buffer(envelope),
        }
    }

    fn fail(&mut self, envelope: Envelope<M, S>, reason: FailureReason) {
        self.dead_letters += 1;
        self.dead_letters_by_reason[reason.index()] += 1;
        self.effects
            .push_back(RegionEffect::Fail { envelope, reason });
    }

    fn buffer(&mut self, mut envelope: Envelope<M, S>) {
        if self.buffered_total >= self.settings.buffer_size {
            return self.fail(envelope, FailureReason::BufferFull);
        }
        Self::detach(self.on_buffer, &mut envelope);
        let s = envelope.shard;
        let d = envelope.deadline;
        let q = self.buffers.entry(s).or_default();
        let first = q.is_empty();
        q.push_back(envelope);
        self.buffered_total += 1;
        self.note_deadline(d);
        let stopping_here = self.shards.contains_key(&s);
        if first && !stopping_here && !self.homes.contains_key(&s) {
            self.ask_home(s);
        }
    }

    /// Keeps [`Self::poll_timeout`] no later than a buffered deadline.
    fn note_deadline(&mut self, deadline: Option<Duration>) {
        if let Some(d) = deadline {
            self.next_deadline_at = Some(self.next_deadline_at.map_or(d, |n| n.min(d)));
        }
    }

    /// Hands back every buffered message whose deadline passed (reason
    /// [`FailureReason::DeadlinePassed`]), in shard order, and recomputes
    /// the earliest deadline of those that stay.
    fn expire_buffered(&mut self, now: Duration) {
        self.fail_buffered_where(
            |e| e.deadline.is_some_and(|d| now >= d),
            FailureReason::DeadlinePassed,
        );
    }

    /// Hands back every message waiting in this region (for a shard home,
    /// a hand-off, a recovery or a passivation) as [`RegionEffect::Fail`]
    /// with `reason`, counted as dead letters; returns how many (count).
    /// The runtime calls this when its node stops (reason
    /// [`FailureReason::ShuttingDown`]): nothing it held is dropped
    /// without an answer.
    pub fn fail_all_buffered(&mut self, reason: FailureReason) -> usize {
        let before = self.dead_letters;
        self.fail_buffered_where(|_| true, reason);
        self.pending_start.clear();
        (self.dead_letters - before) as usize
    }

    /// Fails the buffered messages `pred` selects with `reason` (in shard
    /// order; one shard's keep their order) and recomputes the earliest
    /// deadline of those that stay.
    fn fail_buffered_where(
        &mut self,
        pred: impl Fn(&Envelope<M, S>) -> bool,
        reason: FailureReason,
    ) {
        let mut expired: Vec<(ShardId, Envelope<M, S>)> = Vec::new();
        let mut next: Option<Duration> = None;
        let mut keep = |q: &mut VecDeque<Envelope<M, S>>, s: ShardId| {
            if !q.iter().any(&pred) {
                for d in q.iter().filter_map(|e| e.deadline) {
                    next = Some(next.map_or(d, |n: Duration| n.min(d)));
                }
                return;
            }
            let old = std::mem::take(q);
            for e in old {
                if pred(&e) {
                    expired.push((s, e));
                } else {
                    if let Some(d) = e.deadline {
                        next = Some(next.map_or(d, |n: Duration| n.min(d)));
                    }
                    q.push_back(e);
                }
            }
        };
        for (s, q) in self.buffers.iter_mut() {
            keep(q, *s);
        }
        for (s, sh) in self.shards.iter_mut() {
            if let ShardState::Recovering { pending, .. } = &mut sh.state {
                keep(pending, *s);
            }
            for buffer in sh.passivating.values_mut() {
                keep(buffer, *s);
            }
        }
        self.buffers.retain(|_, q| !q.is_empty());
        self.next_deadline_at = next;
        // Stable: messages of one shard keep their order.
        expired.sort_by_key(|(s, _)| *s);
        self.buffered_total -= expired.len();
        for (_, e) in expired {
            self.fail(e, reason);
        }
    }

    fn start_shard(&mut self, s: ShardId, generation: Generation) {
        let state = if self.settings.remember_entities {
            self.effects
                .push_back(RegionEffect::RecoverRememberedEntities { shard: s });
            ShardState::Recovering {
                pending: VecDeque::new(),
                hand_off: None,
            }
        } else {
            ShardState::Running
        };
        self.shards.insert(
            s,
            Shard {
                generation,
                state,
                entities: DetHashMap::default(),
                passivating: DetHashMap::default(),
            },
        );
    }

    /// Whether the replacement policy tracks the active entities: only
    /// with an active-entity limit (its victims are chosen then only), so
    /// a region without one keeps no per-entity policy state (about 130
    /// bytes an entity) and does no policy work per message.
    fn uses_policy(&self) -> bool {
        self.settings.passivation.active_entity_limit.is_some()
    }

    /// Makes room under the active-entity limit for one more entity.
    fn make_room(&mut self) {
        let Some(limit) = self.settings.passivation.active_entity_limit else {
            return;
        };
        let mut guard = self.active_count + 1;
        while self.active_count >= limit.max(1) && guard > 0 {
            guard -= 1;
            let Some((vs, ve)) = self.policy.select_victim() else {
                break;
            };
            if !self.passivate(&vs, &ve, None, StopReason::ActiveEntityLimit) {
                // Not active: stale in the policy.
                self.policy.on_remove(&(vs, ve));
            }
        }
    }

    /// Activates an entity (new incarnation) in a running shard.
    fn activate(&mut self, now: Duration, s: ShardId, entity: &EntityId) {
        self.make_room();
        let shard = self.shards.get_mut(&s).expect("hosted");
        shard.entities.insert(
            entity.clone(),
            Slot {
                state: Entity::active(now),
                host: H::default(),
            },
        );
        self.active_count += 1;
        if self.uses_policy() {
            self.policy.on_activate(&(s, entity.clone()));
        }
        if self.settings.remember_entities {
            self.effects
                .push_back(RegionEffect::Persist(ShardEvent::EntityStarted {
                    shard: s,
                    entity: entity.clone(),
                }));
        }
    }

    fn deliver_local(&mut self, now: Duration, envelope: Envelope<M, S>) {
        let s = envelope.shard;
        let passive = self.passive.is_some_and(|f| f(&envelope));
        let shard = self.shards.get_mut(&s).expect("hosted");
        match shard
            .entities
            .get_mut(&envelope.entity)
            .map(|e| &mut e.state)
        {
            Some(state) if state.is_active() => {
                if !passive {
                    *state = Entity::active(now);
                    if self.uses_policy() {
                        self.policy.on_access(&(s, envelope.entity.clone()));
                    }
                }
                self.effects.push_back(RegionEffect::Deliver {
                    envelope,
                    new_incarnation: false,
                });
            }
            Some(_) | None if passive => {
                self.effects.push_back(RegionEffect::NotActive { envelope });
            }
            Some(_) => {
                if self.buffered_total >= self.settings.buffer_size {
                    return self.fail(envelope, FailureReason::BufferFull);
                }
                let d = envelope.deadline;
                let mut envelope = envelope;
                Self::detach(self.on_buffer, &mut envelope);
                shard
                    .passivating
                    .entry(envelope.entity.clone())
                    .or_default()
                    .push_back(envelope);
                self.buffered_total += 1;
                self.note_deadline(d);
            }
            None => {
                let entity = envelope.entity.clone();
                self.activate(now, s, &entity);
                self.effects.push_back(RegionEffect::Deliver {
                    envelope,
                    new_incarnation: true,
                });
            }
        }
    }

    /// Stops an active entity; returns whether it was active.
    fn passivate(
        &mut self,
        s: &ShardId,
        entity: &EntityId,
        stop_message: Option<M>,
        reason: StopReason,
    ) -> bool {
        let Some(shard) = self.shards.get_mut(s) else {
            return false;
        };
        let Some(e) = shard.entities.get_mut(entity) else {
            return false;
        };
        if !e.state.is_active() {
            return false;
        }
        e.state = Entity::PASSIVATING;
        self.active_count -= 1;
        if self.uses_policy() {
            self.policy.on_remove(&(*s, entity.clone()));
        }
        if self.settings.remember_entities && reason != StopReason::HandOff {
            self.effects
                .push_back(RegionEffect::Persist(ShardEvent::EntityStopped {
                    shard: *s,
                    entity: entity.clone(),
                }));
        }
        self.effects.push_back(RegionEffect::StopEntity {
            shard: *s,
            entity: entity.clone(),
            stop_message,
            reason,
        });
        true
    }

    /// The entity asked to stop (`Passivate(stop_message)`): it gets
    /// `stop_message` after its queued messages; messages arriving meanwhile
    /// wait and go to its next incarnation. Ignored unless the entity is
    /// active.
    pub fn handle_passivate(
        &mut self,
        now: Duration,
        shard: ShardId,
        entity: &EntityId,
        stop_message: Option<M>,
    ) {
        let _ = now;
        self.passivate(&shard, entity, stop_message, StopReason::Passivate);
    }

    /// `StartEntity`: makes sure the entity runs, at its shard's home
    /// (forwarded there as [`RegionMsg::StartEntity`] when it is elsewhere).
    pub fn handle_start_entity(&mut self, now: Duration, shard: ShardId, entity: EntityId) {
        if let Some(sh) = self.shards.get(&shard) {
            if matches!(sh.state, ShardState::Running) {
                if !sh.entities.contains_key(&entity) {
                    self.activate(now, shard, &entity);
                    self.effects
                        .push_back(RegionEffect::StartEntity { shard, entity });
                }
                return;
            }
        }
        match self.homes.get(&shard) {
            Some((home, g)) if *home == self.id && !self.proxy => {
                if !self.shards.contains_key(&shard) {
                    let g = *g;
                    self.start_shard(shard, g);
                }
                if matches!(self.shards[&shard].state, ShardState::Running) {
                    self.handle_start_entity(now, shard, entity);
                } else {
                    self.pending_start.entry(shard).or_default().push(entity);
                }
            }
            Some((home, _)) if *home != self.id => {
                let to = home.clone();
                self.effects.push_back(RegionEffect::SendToRegion {
                    to,
                    msg: RegionMsg::StartEntity { shard, entity },
                });
            }
            _ => {
                let v = self.pending_start.entry(shard).or_default();
                let first = v.is_empty();
                if v.len() < self.settings.buffer_size {
                    v.push(entity);
                }
                if first && !self.homes.contains_key(&shard) {
                    self.ask_home(shard);
                }
            }
        }
    }

    /// The host's slot of entity `entity` of `shard` while it is live here
    /// (active or stopping; see [`Slot`]); `None` when it is not.
    pub fn host_slot(&self, shard: ShardId, entity: &EntityId) -> Option<&H> {
        self.shards
            .get(&shard)?
            .entities
            .get(entity)
            .map(|e| &e.host)
    }

    /// The host's slot of entity `entity` of `shard`, to change, while it
    /// is live here; `None` when it is not. The runtime keeps the object
    /// that runs the entity here and must take it out before it reports
    /// the stop ([`Self::handle_entity_stopped`] drops the slot).
    pub fn host_slot_mut(&mut self, shard: ShardId, entity: &EntityId) -> Option<&mut H> {
        self.shards
            .get_mut(&shard)?
            .entities
            .get_mut(entity)
            .map(|e| &mut e.host)
    }

    /// Every live entity's host slot, with its shard and id (in the
    /// tables' order), for a runtime that stops every entity at once.
    pub fn host_slots_mut(&mut self) -> impl Iterator<Item = (ShardId, &EntityId, &mut H)> + '_ {
        self.shards.iter_mut().flat_map(|(s, sh)| {
            let s = *s;
            sh.entities
                .iter_mut()
                .map(move |(id, e)| (s, id, &mut e.host))
        })
    }

    /// Whether entity `entity` of `shard` is stopping here: the region
    /// asked it to stop (passivation, hand-off, idle timeout, the
    /// active-entity limit: a [`RegionEffect::StopEntity`]) and has not
    /// been told it stopped. A `StopEntity` that finds the entity not
    /// stopping is stale: the incarnation it was for is gone (it failed
    /// while the effect waited) and the entity is active again.
    pub fn is_entity_stopping(&self, shard: ShardId, entity: &EntityId) -> bool {
        self.shards
            .get(&shard)
            .and_then(|sh| sh.entities.get(entity))
            .is_some_and(|e| !e.state.is_active())
    }

    /// Makes entity `entity` of `shard` live here for a message the host
    /// holds whose incarnation stopped before it ran (the entity failed at
    /// an earlier message of the same batch): when the shard runs here and
    /// the entity is not live, it becomes active, as a message routed to
    /// it now would make it (remember entities: `EntityStarted`), and its
    /// slot is `H::default()`. Returns whether the entity is live here
    /// now; `false` when the shard is not running here (recovering,
    /// handing off or elsewhere).
    pub fn activate_for_host(&mut self, now: Duration, shard: ShardId, entity: &EntityId) -> bool {
        let Some(sh) = self.shards.get(&shard) else {
            return false;
        };
        if sh.entities.contains_key(entity) {
            return true;
        }
        if !matches!(sh.state, ShardState::Running) {
            return false;
        }
        self.activate(now, shard, entity);
        true
    }

    /// The entity processed its stop message and is gone (or died). Its
    /// waiting messages start a new incarnation; during a hand-off too: they
    /// reached this region before the shard was handed off, so they are
    /// processed here, by an incarnation that is stopped again right after
    /// them (see "Ordering" in the module doc).
    pub fn handle_entity_stopped(&mut self, now: Duration, shard: ShardId, entity: &EntityId) {
        let Some(sh) = self.shards.get_mut(&shard) else {
            return;
        };
        let Some(e) = sh.entities.remove(entity) else {
            return;
        };
        let stopping = matches!(sh.state, ShardState::Stopping);
        if e.state.is_active() {
            self.active_count -= 1;
            if self.uses_policy() {
                self.policy.on_remove(&(shard, entity.clone()));
            }
        } else {
            let buffer = sh.passivating.remove(entity).unwrap_or_default();
            self.buffered_total -= buffer.len();
            if stopping {
                self.drain_before_hand_off(now, shard, entity, buffer);
            } else {
                for env in buffer {
                    self.route(now, env);
                }
            }
        }
        if stopping && self.shards[&shard].entities.is_empty() {
            self.finish_stop(now, shard);
        }
    }

    /// A passivating entity of a shard that is handing off stopped with
    /// messages waiting for it. They reached this region before the
    /// `HandOff` (a message that arrives later is buffered for the new home
    /// and never waits here), so they are older than anything that any
    /// region holds for the new home: they are delivered here, to a new
    /// incarnation whose stop message is queued right after them. Sending
    /// them on to the new home instead would race with the messages other
    /// regions buffered meanwhile (simulation seeds passivation 31000309,
    /// 31002081, 31003319). Passive messages never start the incarnation.
    fn drain_before_hand_off(
        &mut self,
        now: Duration,
        s: ShardId,
        entity: &EntityId,
        buffer: VecDeque<Envelope<M, S>>,
    ) {
        let mut started = false;
        for envelope in buffer {
            let passive = self.passive.is_some_and(|f| f(&envelope));
            if started {
                self.effects.push_back(RegionEffect::Deliver {
                    envelope,
                    new_incarnation: false,
                });
            } else if passive {
                self.effects.push_back(RegionEffect::NotActive { envelope });
            } else {
                self.activate(now, s, entity);
                started = true;
                self.effects.push_back(RegionEffect::Deliver {
                    envelope,
                    new_incarnation: true,
                });
            }
        }
        if started {
            self.passivate(&s, entity, None, StopReason::HandOff);
        }
    }

    fn finish_stop(&mut self, now: Duration, s: ShardId) {
        let sh = self.shards.remove(&s).expect("hosted");
        self.hand_offs_completed += 1;
        self.effects.push_back(RegionEffect::SendToCoordinator(
            CoordinatorMsg::ShardStopped {
                shard: s,
                generation: sh.generation,
                region: self.id.clone(),
            },
        ));
        match self.homes.get(&s) {
            Some((home, g)) if *home == self.id => {
                // The coordinator kept the shard here (abandoned hand-off).
                let g = *g;
                self.start_shard(s, g);
                self.flush(now, s);
            }
            Some(_) => self.flush(now, s),
            None => {
                if self.buffers.get(&s).is_some_and(|q| !q.is_empty())
                    || self.pending_start.contains_key(&s)
                {
                    self.ask_home(s);
                }
            }
        }
    }

    fn flush(&mut self, now: Duration, s: ShardId) {
        if let Some(q) = self.buffers.remove(&s) {
            self.buffered_total -= q.len();
            for env in q {
                self.route(now, env);
            }
        }
        if let Some(v) = self.pending_start.remove(&s) {
            for e in v {
                self.handle_start_entity(now, s, e);
            }
        }
    }

    fn floor(&self, s: ShardId) -> Generation {
        self.floors.get(&s).copied().unwrap_or(Generation(0))
    }

    fn raise_floor(&mut self, s: ShardId, g: Generation) {
        let f = self.floors.entry(s).or_insert(g);
        *f = (*f).max(g);
    }

    fn handle_shard_home(&mut self, now: Duration, s: ShardId, home: RegionId, g: Generation) {
        if g < self.floor(s) {
            return; // stale
        }
        self.raise_floor(s, g);
        if self.dead_regions.contains(&home) {
            return;
        }
        self.homes.insert(s, (home.clone(), g));
        if home == self.id && !self.proxy {
            match self.shards.get_mut(&s) {
                Some(sh) => {
                    if !matches!(sh.state, ShardState::Stopping) {
                        sh.generation = sh.generation.max(g);
                    }
                }
                None => self.start_shard(s, g),
            }
        }
        self.flush(now, s);
    }

    /// A control message from the coordinator or another region.
    pub fn handle_region_msg(&mut self, now: Duration, msg: RegionMsg) {
        match msg {
            RegionMsg::RegisterAck => {
                if self.registered {
                    return;
                }
                self.registered = true;
                self.next_retry_at = now + self.settings.retry_interval;
                let waiting: Vec<ShardId> = self
                    .buffers
                    .iter()
                    .filter(|(s, q)| !q.is_empty() && !self.homes.contains_key(s))
                    .map(|(s, _)| *s)
                    .chain(self.pending_start.keys().copied())
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .filter(|s| !self.shards.contains_key(s))
                    .collect();
                for s in waiting {
                    self.ask_home(s);
                }
                if self.shutting_down {
                    self.start_graceful_shutdown(now);
                }
            }
            RegionMsg::ShardHome {
                shard,
                region,
                generation,
            } => self.handle_shard_home(now, shard, region, generation),
            RegionMsg::ShardHomes { homes } => {
                for (s, r, g) in homes {
                    self.handle_shard_home(now, s, r, g);
                }
            }
            RegionMsg::BeginHandOff {
                shard,
                generation,
                owner,
            } => {
                if generation < self.floor(shard) {
                    return;
                }
                self.raise_floor(shard, generation);
                if owner == self.id {
                    // Keep delivering into the running shard until HandOff.
                    self.effects.push_back(RegionEffect::SendToCoordinator(
                        CoordinatorMsg::BeginHandOffAck {
                            shard,
                            generation,
                            region: self.id.clone(),
                        },
                    ));
                    return;
                }
                if self
                    .homes
                    .get(&shard)
                    .is_some_and(|(_, g)| *g <= generation)
                {
                    self.homes.remove(&shard);
                }
                let ack = CoordinatorMsg::BeginHandOffAck {
                    shard,
                    generation,
                    region: self.id.clone(),
                };
                if self.dead_regions.contains(&owner) {
                    self.effects.push_back(RegionEffect::SendToCoordinator(ack));
                } else {
                    // Through the owner, behind what we forwarded to it.
                    self.effects.push_back(RegionEffect::SendToRegion {
                        to: owner,
                        msg: RegionMsg::BeginHandOffAck {
                            shard,
                            generation,
                            region: self.id.clone(),
                        },
                    });
                }
            }
            RegionMsg::BeginHandOffAck {
                shard,
                generation,
                region,
            } => {
                self.effects.push_back(RegionEffect::SendToCoordinator(
                    CoordinatorMsg::BeginHandOffAck {
                        shard,
                        generation,
                        region,
                    },
                ));
            }
            RegionMsg::HandOff { shard, generation } => self.handle_handoff(now, shard, generation),
            RegionMsg::StartEntity { shard, entity } => {
                self.handle_start_entity(now, shard, entity)
            }
        }
    }

    fn handle_handoff(&mut self, now: Duration, s: ShardId, g: Generation) {
        if self.homes.get(&s).is_some_and(|(_, hg)| *hg <= g) {
            self.homes.remove(&s);
        }
        self.raise_floor(s, g);
        let Some(sh) = self.shards.get_mut(&s) else {
            // Not hosted (any more): nothing to stop.
            self.effects.push_back(RegionEffect::SendToCoordinator(
                CoordinatorMsg::ShardStopped {
                    shard: s,
                    generation: g,
                    region: self.id.clone(),
                },
            ));
            return;
        };
        if sh.generation > g || matches!(sh.state, ShardState::Stopping) {
            return; // stale, or already stopping
        }
        if let ShardState::Recovering { hand_off, .. } = &mut sh.state {
            // The messages waiting for the recovery reached this region
            // before the hand-off: they are delivered here first (see
            // "Ordering" in the module doc), then the shard stops.
            *hand_off = Some(g);
            return;
        }
        sh.state = ShardState::Stopping;
        self.hand_offs_begun += 1;
        let active: Vec<EntityId> = sh
            .entities
            .iter()
            .filter(|(_, e)| e.state.is_active())
            .map(|(id, _)| id.clone())
            .collect();
        let mut active = active;
        active.sort();
        for e in active {
            self.passivate(&s, &e, None, StopReason::HandOff);
        }
        self.paced_starts.retain(|(ps, _)| *ps != s);
        if self.shards[&s].entities.is_empty() {
            self.finish_stop(now, s);
        }
    }

    /// Remembered entities of a shard that started here (answer to
    /// [`RegionEffect::RecoverRememberedEntities`]): starts them (all at once
    /// or paced), then delivers the messages that waited.
    pub fn handle_remembered_entities(
        &mut self,
        now: Duration,
        shard: ShardId,
        entities: Vec<EntityId>,
    ) {
        let Some(sh) = self.shards.get_mut(&shard) else {
            return;
        };
        let ShardState::Recovering { .. } = sh.state else {
            return;
        };
        let ShardState::Recovering { pending, hand_off } =
            std::mem::replace(&mut sh.state, ShardState::Running)
        else {
            unreachable!("checked above")
        };
        if let Some(g) = hand_off {
            // Handed off while recovering: the waiting messages are processed
            // here, then the shard stops. The remembered entities stay
            // remembered and start at the new home; `StartEntity` requests
            // wait for it too.
            self.buffered_total -= pending.len();
            for env in pending {
                self.route(now, env);
            }
            self.handle_handoff(now, shard, g);
            return;
        }
        match self.settings.remember_entities_pace {
            RememberEntitiesPace::AllAtOnce => {
                for e in entities {
                    self.handle_start_entity(now, shard, e);
                }
            }
            RememberEntitiesPace::Constant { .. } => {
                self.paced_starts
                    .extend(entities.into_iter().map(|e| (shard, e)));
                if self.next_paced_start_at.is_none() {
                    self.next_paced_start_at = Some(now);
                }
            }
        }
        self.buffered_total -= pending.len();
        for env in pending {
            self.route(now, env);
        }
        if let Some(v) = self.pending_start.remove(&shard) {
            for e in v {
                self.handle_start_entity(now, shard, e);
            }
        }
    }

    /// Membership changes: forgets homes in terminated regions (their shards
    /// are re-allocated by the coordinator and asked for again).
    pub fn handle_membership(&mut self, now: Duration, event: &MembershipEvent) {
        let _ = now;
        let dead: Box<dyn Fn(&RegionId) -> bool + '_> = match event {
            MembershipEvent::MemberRemoved(m) => Box::new(move |r: &RegionId| r.member == *m),
            MembershipEvent::RegionTerminated(t) => Box::new(move |r: &RegionId| r == t),
            MembershipEvent::CurrentMembers(list) => {
                Box::new(move |r: &RegionId| !list.iter().any(|(m, _)| *m == r.member))
            }
            MembershipEvent::MemberUp(_) | MembershipEvent::MemberLeaving(_) => return,
        };
        let gone: Vec<ShardId> = self
            .homes
            .iter()
            .filter(|(_, (r, _))| *r != self.id && dead(r))
            .map(|(s, _)| *s)
            .collect();
        let dead_now: Vec<RegionId> = self
            .homes
            .values()
            .map(|(r, _)| r.clone())
            .filter(|r| *r != self.id && dead(r))
            .collect();
        if let MembershipEvent::RegionTerminated(t) = event {
            self.dead_regions.insert(t.clone());
        }
        drop(dead);
        self.dead_regions.extend(dead_now);
        for s in gone {
            self.homes.remove(&s);
            if self.buffers.get(&s).is_some_and(|q| !q.is_empty()) {
                self.ask_home(s);
            }
        }
    }

    /// Runs due timers: registration and `GetShardHome` retries, the idle
    /// check, paced starts of remembered entities, and the expiry of
    /// buffered messages whose [`Envelope::deadline`] passed (handed back as
    /// [`RegionEffect::Fail`] with [`FailureReason::DeadlinePassed`]).
    pub fn handle_timeout(&mut self, now: Duration) {
        if self.next_deadline_at.is_some_and(|d| now >= d) {
            self.expire_buffered(now);
        }
        if now >= self.next_retry_at {
            self.next_retry_at = now + self.settings.retry_interval;
            if !self.registered {
                self.send_register();
                self.next_retry_at = now + self.register_delay;
                self.register_delay = (self.register_delay * 2).min(self.settings.retry_interval);
            } else {
                let mut waiting: Vec<ShardId> = self
                    .buffers
                    .iter()
                    .filter(|(s, q)| {
                        !q.is_empty() && !self.homes.contains_key(s) && !self.shards.contains_key(s)
                    })
                    .map(|(s, _)| *s)
                    .collect();
                waiting.sort();
                for s in waiting {
                    self.ask_home(s);
                }
                if self.shutting_down && !self.shards.is_empty() {
                    self.effects.push_back(RegionEffect::SendToCoordinator(
                        CoordinatorMsg::GracefulShutdownReq {
                            region: self.id.clone(),
                        },
                    ));
                }
            }
        }
        if let (Some(at), Some(idle)) = (
            self.next_idle_check_at,
            self.settings.passivation.idle_timeout,
        ) {
            if now >= at {
                self.next_idle_check_at = Some(now + idle / 2);
                let mut idle_entities: Vec<EntityKey> = Vec::new();
                for (s, sh) in &self.shards {
                    if !matches!(sh.state, ShardState::Running) {
                        continue;
                    }
                    for (id, e) in &sh.entities {
                        if let Some(last_message_at) = e.state.last_message_at() {
                            if last_message_at + idle <= now {
                                idle_entities.push((*s, id.clone()));
                            }
                        }
                    }
                }
                idle_entities.sort();
                for (s, e) in idle_entities {
                    self.passivate(&s, &e, None, StopReason::IdleTimeout);
                }
            }
        }
        if let Some(at) = self.next_paced_start_at {
            if now >= at {
                if let RememberEntitiesPace::Constant {
                    per_interval,
                    interval,
                } = self.settings.remember_entities_pace
                {
                    for _ in 0..per_interval.max(1) {
                        let Some((s, e)) = self.paced_starts.pop_front() else {
                            break;
                        };
                        self.handle_start_entity(now, s, e);
                    }
                    self.next_paced_start_at =
                        (!self.paced_starts.is_empty()).then_some(now + interval);
                } else {
                    self.next_paced_start_at = None;
                }
            }
        }
    }
}
