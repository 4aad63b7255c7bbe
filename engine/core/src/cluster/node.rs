//! [`ClusterNode`]: one member's whole membership state machine.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use super::downing::{DowningProvider, DowningView, NoDowning, SbrConfig, SplitBrainResolver};
use super::events::{self, ClusterEvent, CurrentClusterState};
use super::gossip::Gossip;
use super::member::{Member, MemberStatus};
use super::message::{ClusterMessage, Transmit};
use super::phi::{PhiAccrualFailureDetector, PhiConfig};
use super::vclock::ClockOrdering;
use crate::ids::{Address, MemberUid, UniqueAddress};

/// Which downing provider a node uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DowningConfig {
    /// No automatic downing ([`ClusterNode::down`] only).
    None,
    /// The split-brain resolver (the default, keep-majority).
    SplitBrainResolver(SbrConfig),
}

/// Settings of a [`ClusterNode`]; defaults are Akka's.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterConfig {
    /// This node's cluster address (`host:port`).
    pub address: Address,
    /// This node's roles. Default none.
    pub roles: BTreeSet<String>,
    /// Seed nodes, in order; only the first may form a new cluster. An empty
    /// list means: wait for [`ClusterNode::join`].
    pub seed_nodes: Vec<Address>,
    /// How long the first seed waits for another seed to answer before it
    /// forms a new cluster with itself. Default 5 s.
    pub seed_node_timeout: Duration,
    /// Interval between `InitJoin` rounds to the seeds. Default 1 s.
    pub seed_retry_interval: Duration,
    /// A join that got no `Welcome` within this is started again from the
    /// seeds. Default 10 s.
    pub retry_unsuccessful_join_after: Duration,
    /// Interval of gossip rounds and leader actions. Default 1 s.
    pub gossip_interval: Duration,
    /// Interval of heartbeats to the monitored members. Default 1 s.
    pub heartbeat_interval: Duration,
    /// When the first heartbeat response has not arrived this long after a
    /// member started to be monitored, its failure detector starts as if
    /// one had (so a member that never answers becomes unreachable).
    /// Default 1 s (Akka `heartbeat-expected-response-after`).
    pub heartbeat_expected_response_after: Duration,
    /// Number of members monitoring each member (count). Default 5.
    pub monitored_by_nr_of_members: usize,
    /// The failure detector's settings.
    pub failure_detector: PhiConfig,
    /// `Some(d)`: a Joining member becomes WeaklyUp after `d` while
    /// convergence is blocked by an unreachable member. Default 7 s; `None`
    /// disables WeaklyUp.
    pub allow_weakly_up_members: Option<Duration>,
    /// The downing provider. Default the keep-majority split-brain resolver
    /// with `stable_after` 20 s.
    pub downing: DowningConfig,
    /// How long a Down member stays before the leader removes it, so that it
    /// has stopped before its shards move (Akka `down-removal-margin`).
    /// Default `None`: with the split-brain resolver, the sum of
    /// `stable_after`, `down_all_when_unstable` (or `stable_after`),
    /// `acceptable_heartbeat_pause` and two `heartbeat_interval`s, the latest
    /// the other side of a partition decides (it must first detect, then
    /// wait until stable, or unstable for too long); 40 s with the defaults.
    /// Zero without a resolver. A Down member whose address
    /// already runs a newer incarnation, or whose process this leader saw
    /// gone ([`Self::refusals_to_down`]), is removed at convergence without
    /// it.
    pub down_removal_margin: Option<Duration>,
    /// A gap longer than this between two inputs means this node was paused
    /// (process stopped, VM frozen): it stops serving (fenced) until a member
    /// answers one of its heartbeats, or learns that it was downed.
    /// Default 3 s.
    pub pause_fence_after: Duration,
    /// Interval of `HandOverToMe` retries. Default 1 s.
    pub hand_over_retry_interval: Duration,
    /// Consecutive refused connections (the shell's
    /// [`ClusterNode::handle_connection_refused`]: ECONNREFUSED or a reset
    /// while connecting, never a timeout) to a member, with no message from
    /// that incarnation in between, after which this node treats the member's
    /// process as gone: the downing provider may down it at once
    /// ([`DowningProvider::decide_refused`], without `stable_after`) and the
    /// leader removes it at convergence, without `down_removal_margin`.
    /// Refusals count at most once per half `refusal_probe_interval`, so the
    /// evidence spans at least `(refusals_to_down - 1) / 2` probe intervals.
    /// Default 3 (count); 0 disables it (only the resolver downs).
    pub refusals_to_down: u32,
    /// After a member's connection was lost or refused, this node sends it a
    /// probe heartbeat at this interval (so the shell connects again and
    /// reports what the socket said) until it answers, is removed, or
    /// nothing was heard about it for two heartbeat intervals. Default
    /// 200 ms.
    pub refusal_probe_interval: Duration,
    /// The coordinator singleton runs on the oldest Up member with this
    /// role. Default none (any member).
    pub coordinator_role: Option<String>,
    /// Seed of this node's random choices (gossip targets). Default 0 (the
    /// constructor mixes in the uid).
    pub random_seed: u64,
}

impl ClusterConfig {
    /// Defaults for a node at `address` with these seeds.
    pub fn new(address: Address, seed_nodes: Vec<Address>) -> Self {
        Self {
            address,
            roles: BTreeSet::new(),
            seed_nodes,
            seed_node_timeout: Duration::from_secs(5),
            seed_retry_interval: Duration::from_secs(1),
            retry_unsuccessful_join_after: Duration::from_secs(10),
            gossip_interval: Duration::from_secs(1),
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_expected_response_after: Duration::from_secs(1),
            monitored_by_nr_of_members: 5,
            failure_detector: PhiConfig::default(),
            allow_weakly_up_members: Some(Duration::from_secs(7)),
            downing: DowningConfig::SplitBrainResolver(SbrConfig::default()),
            down_removal_margin: None,
            pause_fence_after: Duration::from_secs(3),
            hand_over_retry_interval: Duration::from_secs(1),
            refusals_to_down: 3,
            refusal_probe_interval: Duration::from_millis(200),
            coordinator_role: None,
            random_seed: 0,
        }
    }
}

/// Why a node stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// This member was marked Down (by itself or another member) or was
    /// removed without leaving: it must stop its regions and entities at
    /// once, and exit.
    Downed,
    /// This member left gracefully (it is Exiting or removed after leaving);
    /// the process may exit.
    Left,
}

/// A command for the coordinator singleton's host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum SingletonCommand {
    /// Start the coordinator on this node (every other member confirmed that
    /// it does not run it, or was removed).
    Start,
    /// Stop the coordinator; call [`ClusterNode::handle_singleton_stopped`]
    /// once it has stopped.
    Stop,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum JoinState {
    /// No seeds: waiting for [`ClusterNode::join`].
    Idle,
    /// Asking the seeds.
    Seeds {
        next_round: Duration,
        /// Set on the first seed: when to form a new cluster.
        form_at: Option<Duration>,
    },
    /// Sent `Join`, waiting for `Welcome`.
    Joining {
        to: Address,
        give_up_at: Duration,
    },
    Member,
}

#[derive(Debug, Clone)]
struct Monitored {
    fd: PhiAccrualFailureDetector,
    start_at: Duration,
}

/// What this node's connections to one member (incarnation) said.
#[derive(Debug, Clone)]
struct Refusals {
    /// Refused connects counted (at most one per half probe interval).
    count: u32,
    /// When the last one was counted.
    last_counted: Option<Duration>,
    /// The last report about this member (lost or refused).
    last_report: Duration,
    /// The next probe heartbeat.
    next_probe: Duration,
}

impl Refusals {
    /// No refusal counted yet; reported at `now`, probed at `next_probe`.
    fn new(now: Duration, next_probe: Duration) -> Self {
        Refusals {
            count: 0,
            last_counted: None,
            last_report: now,
            next_probe,
        }
    }
}

#[derive(Debug, Clone, Default)]
struct Singleton {
    running: bool,
    stopping: bool,
    /// Members that must confirm before this node starts.
    waiting_for: Option<BTreeSet<UniqueAddress>>,
    next_retry: Duration,
    /// Members to tell `HandOverDone` once stopped.
    notify: BTreeSet<UniqueAddress>,
}

/// One member's membership state machine: seed joining, gossip, leader
/// actions, heartbeats and failure detection, downing, events and the
/// coordinator singleton's placement.
///
/// Order of calls (the runtime's loop):
/// 1. feed inputs: [`Self::handle_message`] for each received message,
///    [`Self::handle_timeout`] when [`Self::poll_timeout`]'s deadline has
///    passed, [`Self::leave`] / [`Self::down`] on operator request,
///    [`Self::handle_singleton_stopped`] when a coordinator stopped;
/// 2. drain the effects: [`Self::poll_stop`] first (if it returns a reason,
///    stop everything of this node before anything else), then
///    [`Self::poll_singleton`], [`Self::poll_transmit`], [`Self::poll_event`];
/// 3. sleep until [`Self::poll_timeout`] or the next message.
///
/// Application traffic must be served only while [`Self::is_available`].
#[derive(Debug)]
pub struct ClusterNode {
    cfg: ClusterConfig,
    self_ua: UniqueAddress,
    join: JoinState,
    /// A seed refused this node: it never forms a cluster of its own.
    seed_refused: bool,
    /// The last refusal, `seed: reason`.
    join_refused: Option<String>,
    gossip: Gossip,
    rng: u64,
    transmits: VecDeque<Transmit>,
    events: VecDeque<ClusterEvent>,
    singleton_cmds: VecDeque<SingletonCommand>,
    stop: Option<StopReason>,
    stop_polled: bool,
    next_gossip: Duration,
    next_heartbeat: Duration,
    heartbeat_seq: u64,
    monitored: BTreeMap<UniqueAddress, Monitored>,
    joining_since: BTreeMap<UniqueAddress, Duration>,
    down_since: BTreeMap<UniqueAddress, Duration>,
    downing: Box<dyn DowningProvider>,
    down_removal_margin: Duration,
    singleton: Singleton,
    last_input: Option<Duration>,
    fence_seq: Option<u64>,
    published: CurrentClusterState,
    downed_replied: BTreeMap<UniqueAddress, Duration>,
    refusals: BTreeMap<UniqueAddress, Refusals>,
    /// The other seeds that answered `InitJoinNack` (they are not members
    /// of any cluster) while this first seed asks the seeds.
    seed_nacks: BTreeSet<Address>,
}

impl ClusterNode {
    /// A node that has not joined yet; `uid` is this incarnation's random
    /// number (draw a new one at every start). With seeds it starts asking
    /// them at `now`.
    pub fn new(cfg: ClusterConfig, uid: MemberUid, now: Duration) -> Self {
        let (downing, margin): (Box<dyn DowningProvider>, Duration) = match &cfg.downing {
            DowningConfig::None => (Box::new(NoDowning), Duration::ZERO),
            DowningConfig::SplitBrainResolver(c) => {
                // The other side may only start to count once its failure
                // detectors noticed (acceptable pause plus two heartbeat
                // intervals), then decides within stable_after, or downs
                // everything at stable_after + down_all_when_unstable.
                // This side's decision may rest on an unreachability older
                // than the partition (a lossy link), so none of it can be
                // taken off (the simulation's `membership-unstable` finds
                // the zombie when stable_after is left out).
                let detection =
                    cfg.failure_detector.acceptable_heartbeat_pause + cfg.heartbeat_interval * 2;
                let unstable = c.down_all_when_unstable.unwrap_or(c.stable_after);
                (
                    Box::new(SplitBrainResolver::new(c.clone())),
                    c.stable_after + unstable + detection,
                )
            }
        };
        let margin = cfg.down_removal_margin.unwrap_or(margin);
        Self::with_downing_provider(cfg, uid, now, downing, margin)
    }

    /// Like [`Self::new`] with a custom downing provider and down-removal
    /// margin (ignores `cfg.downing`).
    pub fn with_downing_provider(
        cfg: ClusterConfig,
        uid: MemberUid,
        now: Duration,
        downing: Box<dyn DowningProvider>,
        down_removal_margin: Duration,
    ) -> Self {
        let self_ua = UniqueAddress {
            address: cfg.address.clone(),
            uid,
        };
        let join = if cfg.seed_nodes.is_empty() {
            JoinState::Idle
        } else {
            let first = cfg.seed_nodes.first() == Some(&cfg.address);
            JoinState::Seeds {
                next_round: now,
                form_at: first.then_some(now + cfg.seed_node_timeout),
            }
        };
        let rng =
            cfg.random_seed ^ uid.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
        Self {
            self_ua,
            join,
            seed_refused: false,
            join_refused: None,
            gossip: Gossip::default(),
            rng,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            singleton_cmds: VecDeque::new(),
            stop: None,
            stop_polled: false,
            next_gossip: now + cfg.gossip_interval,
            next_heartbeat: now + cfg.heartbeat_interval,
            heartbeat_seq: 0,
            monitored: BTreeMap::new(),
            joining_since: BTreeMap::new(),
            down_since: BTreeMap::new(),
            downing,
            down_removal_margin,
            singleton: Singleton::default(),
            last_input: None,
            fence_seq: None,
            published: CurrentClusterState::default(),
            downed_replied: BTreeMap::new(),
            refusals: BTreeMap::new(),
            seed_nacks: BTreeSet::new(),
            cfg,
        }
    }

    // ----- accessors -----

    /// This incarnation.
    pub fn self_address(&self) -> &UniqueAddress {
        &self.self_ua
    }

    /// The local membership state.
    pub fn gossip(&self) -> &Gossip {
        &self.gossip
    }

    /// This member as the local state sees it (`None` before joining).
    pub fn self_member(&self) -> Option<&Member> {
        self.gossip.member(&self.self_ua)
    }

    /// The leader as seen from here.
    pub fn leader(&self) -> Option<UniqueAddress> {
        self.gossip.leader(&self.self_ua)
    }

    /// Whether this node stopped (or must stop).
    pub fn is_stopped(&self) -> bool {
        self.stop.is_some()
    }

    /// Whether this node is fenced after a pause (it must not serve).
    pub fn is_fenced(&self) -> bool {
        self.fence_seq.is_some()
    }

    /// Whether this node may serve application traffic: it is a member with
    /// status WeaklyUp, Up or Leaving, not stopped and not fenced.
    pub fn is_available(&self) -> bool {
        self.stop.is_none()
            && self.fence_seq.is_none()
            && self.self_member().is_some_and(|m| {
                matches!(
                    m.status,
                    MemberStatus::WeaklyUp | MemberStatus::Up | MemberStatus::Leaving
                )
            })
    }

    /// Whether the coordinator singleton runs here (started and not asked to
    /// stop).
    pub fn runs_singleton(&self) -> bool {
        self.singleton.running && !self.singleton.stopping
    }

    /// The oldest Up member with the coordinator role, as seen from here.
    pub fn oldest(&self) -> Option<UniqueAddress> {
        let role = self.cfg.coordinator_role.as_deref();
        self.gossip
            .members
            .values()
            .filter(|m| m.status == MemberStatus::Up && m.has_role(role))
            .reduce(|a, b| if b.is_older_than(a) { b } else { a })
            .map(|m| m.unique_address.clone())
    }

    /// Subscribes: queues a [`ClusterEvent::CurrentClusterState`] with the
    /// published state; the events after it describe every later change.
    pub fn subscribe(&mut self) {
        self.events
            .push_back(ClusterEvent::CurrentClusterState(self.published.clone()));
    }

    /// The published state (what a subscriber's fold of events gives).
    pub fn current_state(&self) -> &CurrentClusterState {
        &self.published
    }

    // ----- effects -----

    /// The reason this node must stop, returned once.
    #[must_use]
    pub fn poll_stop(&mut self) -> Option<StopReason> {
        if self.stop_polled {
            return None;
        }
        let r = self.stop?;
        self.stop_polled = true;
        Some(r)
    }

    /// The next message to send.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next cluster event to publish.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ClusterEvent> {
        self.events.pop_front()
    }

    /// The next command for the coordinator singleton.
    #[must_use]
    pub fn poll_singleton(&mut self) -> Option<SingletonCommand> {
        self.singleton_cmds.pop_front()
    }

    /// When [`Self::handle_timeout`] must be called next (`None` once
    /// stopped).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Duration> {
        if self.stop.is_some() {
            return None;
        }
        let mut t = self.next_heartbeat.min(self.next_gossip);
        match &self.join {
            JoinState::Seeds {
                next_round,
                form_at,
            } => {
                t = t.min(*next_round);
                if let Some(f) = form_at {
                    t = t.min(*f);
                }
            }
            JoinState::Joining { give_up_at, .. } => t = t.min(*give_up_at),
            JoinState::Idle | JoinState::Member => {}
        }
        if self.singleton.waiting_for.is_some() {
            t = t.min(self.singleton.next_retry);
        }
        if self.join == JoinState::Member {
            if let Some(p) = self.refusals.values().map(|r| r.next_probe).min() {
                t = t.min(p);
            }
        }
        if let Some(d) = self.downing.next_deadline() {
            // a deadline already handled (e.g. passed while not the leader)
            // is re-checked after every input anyway
            if self.last_input.is_none_or(|l| d > l) {
                t = t.min(d);
            }
        }
        Some(t)
    }

    // ----- inputs -----

    /// A seed answered this node's connection by refusing it (a different
    /// protocol version or sharding fingerprint, e.g. a mismatched
    /// `number_of_shards`): a seed answered, so this node never forms a
    /// cluster of its own (Akka's rule: only the first seed forms a new
    /// cluster, and only when no other seed answers). It keeps asking the
    /// seeds; the reason is kept for [`Self::join_refused`]. Ignored once
    /// this node is a member.
    pub fn handle_seed_refused(&mut self, now: Duration, seed: &Address, reason: &str) {
        if self.join == JoinState::Member || !self.cfg.seed_nodes.contains(seed) {
            return;
        }
        if let JoinState::Seeds { next_round, .. } = self.join {
            self.join = JoinState::Seeds {
                next_round,
                form_at: None,
            };
        }
        self.seed_refused = true;
        self.join_refused = Some(format!("{seed}: {reason}"));
        self.after_input(now);
    }

    /// The shell's connection to `address` was refused while connecting
    /// (ECONNREFUSED, or reset before the handshake): no process listens
    /// on that cluster port now. Never call it for a timeout or an
    /// unreachable host: those say nothing about the process.
    ///
    /// Counted against every incarnation known at `address` (at most once
    /// per half [`ClusterConfig::refusal_probe_interval`]); once a member has
    /// [`ClusterConfig::refusals_to_down`] of them with no message from it in
    /// between, the downing provider may down it at once and the leader
    /// removes it at convergence (see `docs/node.md`, membership). This node
    /// then probes it every `refusal_probe_interval`.
    pub fn handle_connection_refused(&mut self, now: Duration, address: &Address) {
        if !self.begin(now) {
            return;
        }
        let probe = self.cfg.refusal_probe_interval;
        for ua in self.members_at(address) {
            let r = self
                .refusals
                .entry(ua)
                .or_insert(Refusals::new(now, now + probe));
            r.last_report = now;
            if r.last_counted.is_none_or(|t| now >= t + probe / 2) {
                r.count = r.count.saturating_add(1);
                r.last_counted = Some(now);
            }
            r.next_probe = now + probe;
        }
        self.after_input(now);
    }

    /// The shell's established connection to `address` was closed or reset
    /// by the peer (or failed to connect for another reason than a refusal):
    /// this node probes the members at that address every
    /// [`ClusterConfig::refusal_probe_interval`] for a while, so that a
    /// process that died is seen refusing within a few probes. It is no
    /// evidence by itself: nothing is downed for a lost connection.
    pub fn handle_connection_lost(&mut self, now: Duration, address: &Address) {
        if !self.begin(now) {
            return;
        }
        if self.cfg.refusals_to_down > 0 {
            let probe = self.cfg.refusal_probe_interval;
            for ua in self.members_at(address) {
                let r = self
                    .refusals
                    .entry(ua)
                    .or_insert(Refusals::new(now, now + probe));
                r.last_report = now;
            }
        }
        self.after_input(now);
    }

    /// How many refused connections to `member` this node counted since it
    /// last heard from it (count; 0 when none).
    pub fn refused_count(&self, member: &UniqueAddress) -> u32 {
        self.refusals.get(member).map_or(0, |r| r.count)
    }

    /// Why a seed refused this node (`seed: reason`), while it is not a
    /// member; `None` when no seed refused it.
    pub fn join_refused(&self) -> Option<&str> {
        if self.join == JoinState::Member {
            return None;
        }
        self.join_refused.as_deref()
    }

    /// Joins the cluster through `address` (for nodes without seeds).
    pub fn join(&mut self, now: Duration, address: Address) {
        if !self.begin(now) {
            return;
        }
        if address == self.cfg.address {
            self.form_cluster();
        } else if self.join != JoinState::Member {
            self.send_join(now, address);
        }
        self.after_input(now);
    }

    /// Leaves gracefully: this member becomes Leaving; the leader moves it to
    /// Exiting at convergence and this node then stops with
    /// [`StopReason::Left`]. Hand off this node's shards before calling it
    /// (Akka's coordinated-shutdown order).
    pub fn leave(&mut self, now: Duration) {
        if !self.begin(now) {
            return;
        }
        let me = self.self_ua.clone();
        self.set_status(&me, MemberStatus::Leaving);
        self.after_input(now);
    }

    /// Marks `address` Down (an operator's decision).
    pub fn down(&mut self, now: Duration, member: &UniqueAddress) {
        if !self.begin(now) {
            return;
        }
        self.set_status(member, MemberStatus::Down);
        self.after_input(now);
    }

    /// The coordinator singleton stopped (after [`SingletonCommand::Stop`]).
    pub fn handle_singleton_stopped(&mut self, now: Duration) {
        if !self.begin(now) {
            return;
        }
        if self.singleton.stopping {
            self.singleton.stopping = false;
            self.singleton.running = false;
            let notify = std::mem::take(&mut self.singleton.notify);
            for to in notify {
                self.send(
                    to.address.clone(),
                    ClusterMessage::HandOverDone {
                        from: self.self_ua.clone(),
                        to,
                    },
                );
            }
        }
        self.after_input(now);
    }

    /// Timers: call when `now` reached [`Self::poll_timeout`] (calling it
    /// earlier or more often is harmless).
    pub fn handle_timeout(&mut self, now: Duration) {
        if !self.begin(now) {
            return;
        }
        self.join_timers(now);
        if now >= self.next_heartbeat {
            self.next_heartbeat = now + self.cfg.heartbeat_interval;
            if self.join == JoinState::Member {
                self.heartbeat_round(now);
            }
        }
        if now >= self.next_gossip {
            self.next_gossip = now + self.cfg.gossip_interval;
            if self.join == JoinState::Member {
                self.leader_actions(now);
                self.gossip_round();
            }
        }
        if self.singleton.waiting_for.is_some() && now >= self.singleton.next_retry {
            self.singleton.next_retry = now + self.cfg.hand_over_retry_interval;
            self.send_hand_over_requests();
        }
        self.probe_refused(now);
        self.after_input(now);
    }

    /// A message from another node.
    pub fn handle_message(&mut self, now: Duration, message: ClusterMessage) {
        if !self.begin(now) {
            return;
        }
        let from = message.from().clone();
        if from == self.self_ua {
            self.after_input(now);
            return;
        }
        // A message from this incarnation: it runs, whatever its port said.
        self.refusals.remove(&from);
        if let ClusterMessage::Downed { to, .. } = &message {
            // Down is final, whoever says so: a member that another member
            // holds Down must stop, even when it holds that sender Down or
            // removed itself. Two members that downed each other took
            // conflicting decisions (each kept its own side); Akka's gossip
            // merge then shows each of them Down to itself and both stop.
            // Ignoring the reply because its sender is Down here would keep
            // both running as two clusters, each hosting the coordinator.
            if *to == self.self_ua {
                self.stop_self();
            }
            self.after_input(now);
            return;
        }
        let sender_downed = self.gossip.tombstones.contains(&from)
            || self
                .gossip
                .member(&from)
                .is_some_and(|m| m.status == MemberStatus::Down);
        if sender_downed && !matches!(message, ClusterMessage::InitJoin { .. }) {
            self.reply_downed(now, &from);
            self.after_input(now);
            return;
        }
        match message {
            ClusterMessage::InitJoin { from } => {
                let ok = self.join == JoinState::Member
                    && self.fence_seq.is_none()
                    && self
                        .self_member()
                        .is_some_and(|m| m.status <= MemberStatus::Leaving);
                let me = self.self_ua.clone();
                if ok {
                    self.send(from.address, ClusterMessage::InitJoinAck { from: me });
                } else if self.join != JoinState::Member {
                    // `InitJoinNack` means "not a member of any cluster": the
                    // first seed forms a new cluster once every other seed
                    // said so. A member that cannot take the join now
                    // (fenced, exiting) stays silent instead.
                    self.send(from.address, ClusterMessage::InitJoinNack { from: me });
                }
            }
            ClusterMessage::InitJoinAck { from } => {
                if matches!(self.join, JoinState::Seeds { .. }) {
                    self.send_join(now, from.address);
                }
            }
            ClusterMessage::InitJoinNack { from } => self.receive_init_join_nack(now, from),
            ClusterMessage::Join { from, roles } => self.receive_join(now, from, roles),
            ClusterMessage::Welcome { from, to, gossip } => {
                if to == self.self_ua
                    && matches!(self.join, JoinState::Joining { .. })
                    && gossip.members.contains_key(&self.self_ua)
                {
                    let _ = from;
                    self.join = JoinState::Member;
                    self.gossip = gossip;
                    self.gossip.normalize();
                    self.gossip.seen.insert(self.self_ua.clone());
                }
            }
            ClusterMessage::Gossip { from, to, gossip } => {
                if to == self.self_ua {
                    self.receive_gossip(from, gossip);
                }
            }
            ClusterMessage::GossipStatus {
                from,
                to,
                version,
                seen,
            } => {
                if to == self.self_ua
                    && self.join == JoinState::Member
                    && self.gossip.members.contains_key(&from)
                {
                    match self.gossip.version.compare(&version) {
                        ClockOrdering::After | ClockOrdering::Concurrent => self.send_gossip(&from),
                        ClockOrdering::Before => self.send_status(&from),
                        ClockOrdering::Same => {
                            let members = &self.gossip.members;
                            self.gossip
                                .seen
                                .extend(seen.iter().filter(|u| members.contains_key(*u)).cloned());
                            if !self.gossip.seen.is_subset(&seen) {
                                self.send_status(&from);
                            }
                        }
                    }
                }
            }
            ClusterMessage::Heartbeat {
                from,
                to,
                sequence_nr,
            } => {
                if to == self.self_ua {
                    let msg = ClusterMessage::HeartbeatRsp {
                        from: self.self_ua.clone(),
                        to: from.clone(),
                        sequence_nr,
                    };
                    self.send(from.address, msg);
                }
            }
            ClusterMessage::HeartbeatRsp {
                from,
                to,
                sequence_nr,
            } => {
                if to == self.self_ua {
                    if let Some(m) = self.monitored.get_mut(&from) {
                        m.fd.heartbeat(now);
                    }
                    if self.fence_seq.is_some_and(|s| sequence_nr >= s)
                        && self.gossip.members.contains_key(&from)
                    {
                        self.fence_seq = None;
                    }
                }
            }
            // handled above, whatever the sender's status
            ClusterMessage::Downed { .. } => {}
            ClusterMessage::HandOverToMe { from, to } => {
                if to == self.self_ua {
                    self.receive_hand_over_to_me(from);
                }
            }
            ClusterMessage::HandOverDone { from, to } => {
                if to == self.self_ua {
                    if let Some(w) = self.singleton.waiting_for.as_mut() {
                        w.remove(&from);
                    }
                }
            }
        }
        self.after_input(now);
    }

    // ----- internals -----

    /// Common prologue: returns false when stopped; detects a pause.
    fn begin(&mut self, now: Duration) -> bool {
        if self.stop.is_some() {
            return false;
        }
        if let Some(last) = self.last_input {
            if now > last + self.cfg.pause_fence_after && self.join == JoinState::Member {
                self.on_pause(now);
            }
        }
        self.last_input = Some(self.last_input.map_or(now, |l| l.max(now)));
        true
    }

    /// This node was paused: fence it, stop the singleton, restart the
    /// failure detectors (the silence was ours) and probe the members.
    fn on_pause(&mut self, now: Duration) {
        self.heartbeat_seq += 1;
        self.fence_seq = Some(self.heartbeat_seq);
        if self.singleton.running && !self.singleton.stopping {
            self.singleton.stopping = true;
            self.singleton_cmds.push_back(SingletonCommand::Stop);
        }
        self.singleton.waiting_for = None;
        for m in self.monitored.values_mut() {
            m.fd = PhiAccrualFailureDetector::new(self.cfg.failure_detector.clone());
            m.start_at = now + self.cfg.heartbeat_expected_response_after;
        }
        let targets: Vec<UniqueAddress> = self
            .gossip
            .members
            .keys()
            .filter(|u| **u != self.self_ua)
            .cloned()
            .collect();
        for to in targets {
            let msg = ClusterMessage::Heartbeat {
                from: self.self_ua.clone(),
                to: to.clone(),
                sequence_nr: self.heartbeat_seq,
            };
            self.send(to.address, msg);
        }
        self.next_heartbeat = now + self.cfg.heartbeat_interval;
    }

    /// The incarnations at `address` in the local state (not this node).
    fn members_at(&self, address: &Address) -> Vec<UniqueAddress> {
        self.gossip
            .members
            .keys()
            .filter(|u| u.address == *address && **u != self.self_ua)
            .cloned()
            .collect()
    }

    /// Whether this node counted enough refusals from `ua` to treat its
    /// process as gone.
    fn refusal_confirmed(&self, ua: &UniqueAddress) -> bool {
        self.cfg.refusals_to_down > 0
            && self
                .refusals
                .get(ua)
                .is_some_and(|r| r.count >= self.cfg.refusals_to_down)
    }

    /// Probe heartbeats to the members whose connection was lost or refused
    /// (and, on the leader, to Down members awaiting removal, so that it
    /// has its own evidence to remove them without the margin). Entries
    /// without a report for two heartbeat intervals are dropped.
    fn probe_refused(&mut self, now: Duration) {
        if self.join != JoinState::Member || self.cfg.refusals_to_down == 0 {
            return;
        }
        let window = self.cfg.heartbeat_interval * 2;
        let g = &self.gossip;
        self.refusals
            .retain(|u, r| g.members.contains_key(u) && now < r.last_report + window);
        self.probe_down_members(now);
        let probe = self.cfg.refusal_probe_interval;
        let due: Vec<UniqueAddress> = self
            .refusals
            .iter_mut()
            .filter(|(_, r)| now >= r.next_probe)
            .map(|(u, r)| {
                r.next_probe = now + probe;
                u.clone()
            })
            .collect();
        for to in due {
            let msg = ClusterMessage::Heartbeat {
                from: self.self_ua.clone(),
                to: to.clone(),
                sequence_nr: self.heartbeat_seq,
            };
            self.send(to.address, msg);
        }
    }

    /// On the leader: probe the Down members awaiting removal (from the
    /// next poll on).
    fn probe_down_members(&mut self, now: Duration) {
        if self.join != JoinState::Member
            || self.cfg.refusals_to_down == 0
            || self.leader().as_ref() != Some(&self.self_ua)
        {
            return;
        }
        {
            let down: Vec<UniqueAddress> = self
                .gossip
                .members
                .values()
                .filter(|m| m.status == MemberStatus::Down && m.unique_address != self.self_ua)
                .map(|m| m.unique_address.clone())
                .collect();
            for u in down {
                self.refusals.entry(u).or_insert(Refusals::new(now, now));
            }
        }
    }

    /// Downing on refused connections: when this node has confirmed
    /// refusals from some members, the downing provider may down them (or
    /// this node) at once; see [`DowningProvider::decide_refused`].
    fn run_refused_downing(&mut self, now: Duration) {
        if self.cfg.refusals_to_down == 0
            || self.join != JoinState::Member
            || self.fence_seq.is_some()
            || self
                .self_member()
                .is_none_or(|m| m.status >= MemberStatus::Down)
        {
            return;
        }
        let confirmed: BTreeSet<UniqueAddress> = self
            .refusals
            .keys()
            .filter(|u| {
                // An Exiting member is removed by the leader anyway.
                self.refusal_confirmed(u)
                    && self
                        .gossip
                        .member(u)
                        .is_some_and(|m| m.status < MemberStatus::Exiting)
            })
            .cloned()
            .collect();
        if confirmed.is_empty() {
            return;
        }
        let is_leader = self.leader().as_ref() == Some(&self.self_ua);
        let view = DowningView {
            gossip: &self.gossip,
            self_address: &self.self_ua,
            is_leader,
        };
        if let Some(decision) = self.downing.decide_refused(now, view, &confirmed) {
            self.apply_downing(&decision.down, true);
        }
    }

    /// Whether a Down member may be removed without the margin because this
    /// node confirmed that its process is gone (the leader then acts on
    /// every input, not only on its gossip tick).
    fn removal_by_refusal_pending(&self) -> bool {
        self.gossip
            .members
            .values()
            .any(|m| m.status == MemberStatus::Down && self.gone_for_sure(&m.unique_address))
    }

    /// Whether the process of `ua` is known to be gone: this node confirmed
    /// refusals from it, or a newer incarnation runs at its address.
    fn gone_for_sure(&self, ua: &UniqueAddress) -> bool {
        self.refusal_confirmed(ua)
            || self.gossip.members.keys().any(|o| {
                o.address == ua.address && o.uid != ua.uid && !self.gossip.tombstones.contains(o)
            })
    }

    /// Every other member gets this node's gossip now.
    fn gossip_to_all(&mut self) {
        let others: Vec<UniqueAddress> = self
            .gossip
            .members
            .keys()
            .filter(|u| **u != self.self_ua)
            .cloned()
            .collect();
        for o in others {
            self.send_gossip(&o);
        }
    }

    fn send(&mut self, to: Address, message: ClusterMessage) {
        self.transmits.push_back(Transmit { to, message });
    }

    fn next_random(&mut self) -> u64 {
        // SplitMix64 (Steele, Lea, Flood 2014).
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn reply_downed(&mut self, now: Duration, to: &UniqueAddress) {
        let due = self
            .downed_replied
            .get(to)
            .is_none_or(|t| now >= *t + self.cfg.heartbeat_interval);
        if due && self.join == JoinState::Member {
            self.downed_replied.insert(to.clone(), now);
            let msg = ClusterMessage::Downed {
                from: self.self_ua.clone(),
                to: to.clone(),
            };
            self.send(to.address.clone(), msg);
        }
    }

    fn join_timers(&mut self, now: Duration) {
        match self.join.clone() {
            JoinState::Seeds {
                next_round,
                form_at,
            } => {
                if form_at.is_some_and(|f| now >= f) && !self.seed_refused {
                    self.form_cluster();
                    return;
                }
                if now >= next_round {
                    let seeds: Vec<Address> = self
                        .cfg
                        .seed_nodes
                        .iter()
                        .filter(|a| **a != self.cfg.address)
                        .cloned()
                        .collect();
                    for s in seeds {
                        self.send(
                            s,
                            ClusterMessage::InitJoin {
                                from: self.self_ua.clone(),
                            },
                        );
                    }
                    self.join = JoinState::Seeds {
                        next_round: now + self.cfg.seed_retry_interval,
                        form_at,
                    };
                }
            }
            JoinState::Joining { give_up_at, .. } => {
                if now >= give_up_at {
                    self.join = if self.cfg.seed_nodes.is_empty() {
                        JoinState::Idle
                    } else {
                        JoinState::Seeds {
                            next_round: now,
                            form_at: None,
                        }
                    };
                    self.join_timers(now);
                }
            }
            JoinState::Idle | JoinState::Member => {}
        }
    }

    /// On the first seed (Akka's `FirstSeedNodeProcess`): once every other
    /// seed answered that it is not a member of any cluster, no cluster
    /// exists to join, and waiting for `seed_node_timeout` would only delay
    /// the start; the first seed forms the cluster at once and tells those
    /// seeds (`InitJoinAck`) so that they join without waiting for their
    /// next round.
    fn receive_init_join_nack(&mut self, now: Duration, from: UniqueAddress) {
        let JoinState::Seeds {
            form_at: Some(_), ..
        } = self.join
        else {
            return;
        };
        if self.seed_refused || !self.cfg.seed_nodes.contains(&from.address) {
            return;
        }
        self.seed_nacks.insert(from.address);
        let all = self
            .cfg
            .seed_nodes
            .iter()
            .filter(|a| **a != self.cfg.address)
            .all(|a| self.seed_nacks.contains(a));
        if !all {
            return;
        }
        self.form_cluster();
        self.next_gossip = now;
        let nacked: Vec<Address> = std::mem::take(&mut self.seed_nacks).into_iter().collect();
        for a in nacked {
            let msg = ClusterMessage::InitJoinAck {
                from: self.self_ua.clone(),
            };
            self.send(a, msg);
        }
    }

    fn send_join(&mut self, now: Duration, to: Address) {
        self.join = JoinState::Joining {
            to: to.clone(),
            give_up_at: now + self.cfg.retry_unsuccessful_join_after,
        };
        let msg = ClusterMessage::Join {
            from: self.self_ua.clone(),
            roles: self.cfg.roles.clone(),
        };
        self.send(to, msg);
    }

    fn form_cluster(&mut self) {
        self.join = JoinState::Member;
        let mut g = Gossip::default();
        let me = Member::joining(self.self_ua.clone(), self.cfg.roles.clone());
        g.members.insert(self.self_ua.clone(), me);
        g.bump(&self.self_ua);
        self.gossip = g;
    }

    fn receive_join(&mut self, now: Duration, from: UniqueAddress, roles: BTreeSet<String>) {
        let accept = self.join == JoinState::Member
            && self.fence_seq.is_none()
            && self
                .self_member()
                .is_some_and(|m| m.status <= MemberStatus::Leaving);
        if !accept || self.gossip.tombstones.contains(&from) {
            return;
        }
        if !self.gossip.members.contains_key(&from) {
            let old: Vec<UniqueAddress> = self
                .gossip
                .members
                .values()
                .filter(|m| {
                    m.unique_address.address == from.address && m.status < MemberStatus::Down
                })
                .map(|m| m.unique_address.clone())
                .collect();
            for o in old {
                if let Some(m) = self.gossip.members.get_mut(&o) {
                    m.status = MemberStatus::Down;
                }
            }
            self.gossip
                .members
                .insert(from.clone(), Member::joining(from.clone(), roles));
            self.joining_since.insert(from.clone(), now);
            self.gossip.bump(&self.self_ua);
            // Leader actions (and a gossip round) at the next poll instead
            // of the next tick: a joiner is made Up as soon as convergence
            // allows.
            self.next_gossip = self.next_gossip.min(now);
            // Every member learns of the joiner now, not at the next round
            // (to one random member): a contact that crashed before that
            // round would leave the joiner Joining for good, as the others
            // ignore gossip from a member they do not know. A replaced
            // incarnation is gone for sure (Akka downs it when the new one
            // joins), so the leader removes it at the next convergence.
            self.gossip_to_all();
        }
        let msg = ClusterMessage::Welcome {
            from: self.self_ua.clone(),
            to: from.clone(),
            gossip: self.gossip.clone(),
        };
        self.send(from.address, msg);
    }

    fn receive_gossip(&mut self, from: UniqueAddress, remote: Gossip) {
        if self.join != JoinState::Member || !self.gossip.members.contains_key(&from) {
            return;
        }
        if remote.tombstones.contains(&self.self_ua) {
            self.stop_self();
            return;
        }
        let ord = self.gossip.version.compare(&remote.version);
        let talkback = !remote.seen.contains(&self.self_ua);
        let mut merged = self.gossip.merge(&remote);
        merged.seen.insert(self.self_ua.clone());
        self.gossip = merged;
        if self.removal_by_refusal_pending() {
            // A member whose process is gone awaits removal: the leader
            // learns at once that this member has seen the version.
            if let Some(l) = self.leader().filter(|l| *l != self.self_ua && *l != from) {
                self.send_status(&l);
            }
        }
        if matches!(ord, ClockOrdering::After | ClockOrdering::Concurrent) {
            self.send_gossip(&from);
        } else if talkback {
            // The sender does not know that this member has seen its
            // version: tell it (Akka's talkback in `receiveGossip`). Without
            // this, a leader that gossips its version to the members that
            // have not seen it never learns that they have, and waits for
            // convergence until one of them happens to pick it for a
            // gossip round (a graceful leave then hangs).
            self.send_status(&from);
        }
    }

    fn send_gossip(&mut self, to: &UniqueAddress) {
        let msg = ClusterMessage::Gossip {
            from: self.self_ua.clone(),
            to: to.clone(),
            gossip: self.gossip.clone(),
        };
        self.send(to.address.clone(), msg);
    }

    fn send_status(&mut self, to: &UniqueAddress) {
        let msg = ClusterMessage::GossipStatus {
            from: self.self_ua.clone(),
            to: to.clone(),
            version: self.gossip.version.clone(),
            seen: self.gossip.seen.clone(),
        };
        self.send(to.address.clone(), msg);
    }

    fn gossip_round(&mut self) {
        let unreachable = self.gossip.unreachable_members();
        let candidates: Vec<UniqueAddress> = self
            .gossip
            .members
            .values()
            .filter(|m| {
                m.unique_address != self.self_ua
                    && m.status != MemberStatus::Down
                    && !unreachable.contains(&m.unique_address)
            })
            .map(|m| m.unique_address.clone())
            .collect();
        if candidates.is_empty() {
            return;
        }
        let not_seen: Vec<&UniqueAddress> = candidates
            .iter()
            .filter(|c| !self.gossip.seen.contains(*c))
            .collect();
        let r = self.next_random();
        // Prefer members that have not seen this version (Akka's
        // gossip-different-view-probability 0.8).
        let target = if !not_seen.is_empty() && r % 10 < 8 {
            not_seen[(r / 10) as usize % not_seen.len()].clone()
        } else {
            candidates[(r / 10) as usize % candidates.len()].clone()
        };
        if self.gossip.seen.contains(&target) {
            self.send_status(&target);
        } else {
            self.send_gossip(&target);
        }
    }

    /// The members this node sends heartbeats to: walking the ring of members
    /// sorted by unique address from this node, the next
    /// `monitored_by_nr_of_members` reachable ones plus the unreachable ones
    /// met on the way (Akka's `HeartbeatNodeRing`).
    pub fn heartbeat_receivers(&self) -> BTreeSet<UniqueAddress> {
        let ring: Vec<&UniqueAddress> = self
            .gossip
            .members
            .values()
            .filter(|m| m.status != MemberStatus::Down)
            .map(|m| &m.unique_address)
            .collect();
        let unreachable = self.gossip.unreachable_members();
        let mut out = BTreeSet::new();
        let Some(pos) = ring.iter().position(|u| **u == self.self_ua) else {
            return out;
        };
        let mut reachable = 0;
        for i in 1..ring.len() {
            if reachable >= self.cfg.monitored_by_nr_of_members {
                break;
            }
            let u = ring[(pos + i) % ring.len()];
            out.insert(u.clone());
            if !unreachable.contains(u) {
                reachable += 1;
            }
        }
        out
    }

    fn heartbeat_round(&mut self, now: Duration) {
        let receivers = self.heartbeat_receivers();
        self.monitored.retain(|u, _| receivers.contains(u));
        self.heartbeat_seq += 1;
        for r in &receivers {
            self.monitored
                .entry(r.clone())
                .or_insert_with(|| Monitored {
                    fd: PhiAccrualFailureDetector::new(self.cfg.failure_detector.clone()),
                    start_at: now + self.cfg.heartbeat_expected_response_after,
                });
            let msg = ClusterMessage::Heartbeat {
                from: self.self_ua.clone(),
                to: r.clone(),
                sequence_nr: self.heartbeat_seq,
            };
            self.send(r.address.clone(), msg);
        }
        // Reaper: mark the monitored members by this node's detectors.
        let observing = self
            .self_member()
            .is_some_and(|m| m.status < MemberStatus::Down);
        if !observing || self.fence_seq.is_some() {
            return;
        }
        let mut changed = false;
        let me = self.self_ua.clone();
        for (u, m) in self.monitored.iter_mut() {
            if !m.fd.is_monitoring() && now >= m.start_at {
                m.fd.heartbeat(m.start_at);
            }
            let unreachable_by_me = self.gossip.reachability.is_unreachable_by(&me, u);
            let available = m.fd.is_available(now);
            if !available && !unreachable_by_me {
                changed |= self.gossip.reachability.unreachable(&me, u);
            } else if available && unreachable_by_me {
                changed |= self.gossip.reachability.reachable(&me, u);
            }
        }
        // Records about members this node no longer monitors are cleared,
        // except a Down member's: it is no longer monitored because it is
        // Down, and it stays unreachable until it is removed (as in Akka,
        // whose reachability drops a member's records at its removal), so
        // that no `ReachableMember` is published for a member that never
        // answered again.
        let stale: Vec<UniqueAddress> = self
            .gossip
            .reachability
            .records
            .get(&me)
            .map(|r| {
                r.unreachable
                    .iter()
                    .filter(|u| {
                        !self.monitored.contains_key(*u)
                            && self
                                .gossip
                                .members
                                .get(*u)
                                .is_none_or(|m| m.status != MemberStatus::Down)
                    })
                    .cloned()
                    .collect()
            })
            .unwrap_or_default();
        for u in stale {
            changed |= self.gossip.reachability.reachable(&me, &u);
        }
        if changed {
            self.gossip.bump(&me);
        }
    }

    fn set_status(&mut self, ua: &UniqueAddress, status: MemberStatus) {
        if let Some(m) = self.gossip.members.get_mut(ua) {
            if m.status.can_transition_to(status) {
                m.status = status;
                self.gossip.bump(&self.self_ua);
            }
        }
    }

    fn leader_actions(&mut self, now: Duration) {
        // Track how long members have been Joining / Down (local timers).
        for m in self.gossip.members.values() {
            if m.status == MemberStatus::Joining {
                self.joining_since
                    .entry(m.unique_address.clone())
                    .or_insert(now);
            }
            if m.status == MemberStatus::Down {
                self.down_since
                    .entry(m.unique_address.clone())
                    .or_insert(now);
            }
        }
        let g = &self.gossip;
        self.joining_since.retain(|u, _| {
            g.members
                .get(u)
                .is_some_and(|m| m.status == MemberStatus::Joining)
        });
        self.down_since.retain(|u, _| {
            g.members
                .get(u)
                .is_some_and(|m| m.status == MemberStatus::Down)
        });
        if self.leader().as_ref() != Some(&self.self_ua) || self.fence_seq.is_some() {
            return;
        }
        let me = self.self_ua.clone();
        if self
            .self_member()
            .is_none_or(|m| m.status >= MemberStatus::Exiting)
        {
            return;
        }
        let mut changed = false;
        if self.gossip.convergence() {
            let unreachable = self.gossip.unreachable_members();
            let mut next_up = self
                .gossip
                .members
                .values()
                .map(|m| m.up_number)
                .max()
                .unwrap_or(0);
            let mut remove = Vec::new();
            let mut moved_up: Vec<UniqueAddress> = Vec::new();
            let addresses: Vec<UniqueAddress> = self.gossip.members.keys().cloned().collect();
            for ua in addresses {
                let newer_incarnation = self.gossip.members.keys().any(|o| {
                    o.address == ua.address
                        && o.uid != ua.uid
                        && !self.gossip.tombstones.contains(o)
                }) && self
                    .gossip
                    .members
                    .get(&ua)
                    .is_some_and(|m| m.status == MemberStatus::Down);
                let seen = self.gossip.seen.contains(&ua);
                let down_since = self.down_since.get(&ua).copied();
                let refused = self.refusal_confirmed(&ua);
                let Some(m) = self.gossip.members.get_mut(&ua) else {
                    continue;
                };
                match m.status {
                    MemberStatus::Joining | MemberStatus::WeaklyUp => {
                        next_up += 1;
                        m.status = MemberStatus::Up;
                        m.up_number = next_up;
                        changed = true;
                        moved_up.push(ua.clone());
                    }
                    MemberStatus::Leaving => {
                        m.status = MemberStatus::Exiting;
                        changed = true;
                    }
                    MemberStatus::Exiting if seen || unreachable.contains(&ua) => remove.push(ua),
                    MemberStatus::Down
                        if newer_incarnation
                            || refused
                            || down_since.is_some_and(|d| now >= d + self.down_removal_margin) =>
                    {
                        remove.push(ua)
                    }
                    _ => {}
                }
            }
            let mut tell_all = false;
            for ua in remove {
                if ua != me {
                    tell_all |= self.gone_for_sure(&ua);
                    self.refusals.remove(&ua);
                    self.gossip.remove_member(&ua);
                    changed = true;
                }
            }
            if tell_all {
                // The shards of a process known to be gone move now: every
                // member (and the coordinator's host) learns it at once.
                self.gossip.bump(&me);
                changed = false;
                self.gossip_to_all();
            } else if !moved_up.is_empty() {
                // A member made Up learns it now, not when a gossip round
                // happens to pick it.
                self.gossip.bump(&me);
                changed = false;
                for u in moved_up.iter().filter(|u| **u != me) {
                    self.send_gossip(u);
                }
            }
        } else if let Some(after) = self.cfg.allow_weakly_up_members {
            if self.gossip.has_unreachable_blocking() {
                let unreachable = self.gossip.unreachable_members();
                for (ua, since) in &self.joining_since {
                    if now >= *since + after && !unreachable.contains(ua) {
                        if let Some(m) = self.gossip.members.get_mut(ua) {
                            if m.status == MemberStatus::Joining {
                                m.status = MemberStatus::WeaklyUp;
                                changed = true;
                            }
                        }
                    }
                }
            }
        }
        if changed {
            self.gossip.bump(&me);
        }
    }

    fn run_downing(&mut self, now: Duration) {
        if self.join != JoinState::Member || self.fence_seq.is_some() {
            return;
        }
        let is_leader = self.leader().as_ref() == Some(&self.self_ua);
        let view = DowningView {
            gossip: &self.gossip,
            self_address: &self.self_ua,
            is_leader,
        };
        let Some(decision) = self.downing.update(now, view) else {
            return;
        };
        self.apply_downing(&decision.down, false);
    }

    /// Marks `down` Down; tells every other member at once when this node
    /// is among them, or when `tell_all`.
    fn apply_downing(&mut self, down: &BTreeSet<UniqueAddress>, tell_all: bool) {
        let mut changed = false;
        for ua in down {
            if let Some(m) = self.gossip.members.get_mut(ua) {
                if m.status.can_transition_to(MemberStatus::Down) {
                    m.status = MemberStatus::Down;
                    changed = true;
                }
            }
        }
        if changed {
            self.gossip.bump(&self.self_ua);
            if tell_all || down.contains(&self.self_ua) {
                // Tell the rest of this side before stopping.
                let targets: Vec<UniqueAddress> = self
                    .gossip
                    .members
                    .keys()
                    .filter(|u| **u != self.self_ua)
                    .cloned()
                    .collect();
                for t in targets {
                    self.send_gossip(&t);
                }
            }
        }
    }

    fn receive_hand_over_to_me(&mut self, from: UniqueAddress) {
        let oldest = self.oldest();
        if self.singleton.running {
            if oldest.as_ref() == Some(&from) || self.singleton.stopping {
                self.singleton.notify.insert(from);
            }
            return;
        }
        if oldest.as_ref() == Some(&self.self_ua) {
            return; // it will see that this node is older
        }
        let msg = ClusterMessage::HandOverDone {
            from: self.self_ua.clone(),
            to: from.clone(),
        };
        self.send(from.address, msg);
    }

    fn send_hand_over_requests(&mut self) {
        let targets: Vec<UniqueAddress> = self
            .singleton
            .waiting_for
            .iter()
            .flatten()
            .cloned()
            .collect();
        for to in targets {
            let msg = ClusterMessage::HandOverToMe {
                from: self.self_ua.clone(),
                to: to.clone(),
            };
            self.send(to.address, msg);
        }
    }

    fn update_singleton(&mut self, now: Duration) {
        if self.join != JoinState::Member {
            return;
        }
        let oldest = self.oldest();
        let me_oldest = oldest.as_ref() == Some(&self.self_ua) && self.fence_seq.is_none();
        if !me_oldest {
            self.singleton.waiting_for = None;
            if self.singleton.running && !self.singleton.stopping {
                self.singleton.stopping = true;
                self.singleton_cmds.push_back(SingletonCommand::Stop);
            }
            if let Some(o) = oldest {
                if self.singleton.stopping && o != self.self_ua {
                    self.singleton.notify.insert(o);
                }
            }
            return;
        }
        if self.singleton.running {
            return;
        }
        if self.singleton.waiting_for.is_none() {
            let others: BTreeSet<UniqueAddress> = self
                .gossip
                .members
                .keys()
                .filter(|u| **u != self.self_ua)
                .cloned()
                .collect();
            self.singleton.waiting_for = Some(others);
            self.singleton.next_retry = now;
        }
        let members = &self.gossip.members;
        if let Some(w) = self.singleton.waiting_for.as_mut() {
            w.retain(|u| members.contains_key(u));
            if w.is_empty() {
                self.singleton.waiting_for = None;
                self.singleton.running = true;
                self.singleton_cmds.push_back(SingletonCommand::Start);
            } else if now >= self.singleton.next_retry {
                self.singleton.next_retry = now + self.cfg.hand_over_retry_interval;
                self.send_hand_over_requests();
            }
        }
    }

    fn stop_self(&mut self) {
        if self.stop.is_some() {
            return;
        }
        let left = self
            .self_member()
            .is_some_and(|m| matches!(m.status, MemberStatus::Leaving | MemberStatus::Exiting));
        self.stop = Some(if left {
            StopReason::Left
        } else {
            StopReason::Downed
        });
        self.singleton.running = false;
        self.singleton.waiting_for = None;
    }

    /// Common epilogue: downing, self status, singleton, events.
    fn after_input(&mut self, now: Duration) {
        if self.stop.is_none() {
            self.probe_down_members(now);
            self.run_refused_downing(now);
            if self.join == JoinState::Member && self.removal_by_refusal_pending() {
                self.leader_actions(now);
            }
            self.run_downing(now);
        }
        if self.stop.is_none() && self.join == JoinState::Member {
            if self.fence_seq.is_some() && !self.gossip.members.keys().any(|u| *u != self.self_ua) {
                self.fence_seq = None;
            }
            match self.self_member().map(|m| m.status) {
                Some(MemberStatus::Down) => self.stop_self(),
                Some(MemberStatus::Exiting) => {
                    // Make sure the leader learns this member saw it, then stop.
                    let others: Vec<UniqueAddress> = self
                        .gossip
                        .members
                        .keys()
                        .filter(|u| **u != self.self_ua)
                        .cloned()
                        .collect();
                    for o in others {
                        self.send_gossip(&o);
                    }
                    self.stop_self();
                }
                None => self.stop_self(),
                _ => {}
            }
        }
        if self.stop.is_none() {
            self.update_singleton(now);
        }
        let state = CurrentClusterState {
            members: self.gossip.members.clone(),
            unreachable: self.gossip.unreachable_members(),
            leader: if self.join == JoinState::Member {
                self.leader()
            } else {
                None
            },
        };
        for e in events::diff(&self.published, &state) {
            self.events.push_back(e);
        }
        self.published = state;
    }
}
