//! The control plane: the sans-IO half of the control executor.
//!
//! [`ControlPlane`] owns the membership state machine (`ClusterNode`), the
//! hosted `ShardCoordinator`s (one per entity type while this member is the
//! oldest), the coordinators' replicated state, the region messages held
//! until the coordinator events before them are durable, the graceful
//! leave and the choice of where a new coordinator recovers from and with
//! which writer epoch. It has no sockets, no timers, no clock and no
//! thread-locals: the driver (`node/control.rs`, or the simulation) feeds
//! it inputs with the time they happened at and carries out its outputs.
//!
//! # Order of calls
//!
//! After [`ControlPlane::new`], and after every `handle_*` call:
//!
//! 1. drain [`ControlPlane::poll_event`] (stop requests, readiness, answers
//!    to admin and stats requests, cluster events for subscribers),
//! 2. drain [`ControlPlane::poll_transmit`] (control frames to other
//!    members) and [`ControlPlane::poll_to_cores`] (messages to the data
//!    cores),
//! 3. drain [`ControlPlane::poll_journal`] and carry out each operation in
//!    the order given (a recovery's outcome, a refused append, are fed back
//!    with [`ControlPlane::handle_recovered`] and
//!    [`ControlPlane::handle_journal_refused`], which queue more outputs:
//!    go back to 1 until every queue is empty); then, for every type whose
//!    journal wants a snapshot, [`ControlPlane::handle_snapshot_due`],
//! 4. arm a timer for [`ControlPlane::poll_timeout`] and call
//!    [`ControlPlane::handle_timeout`] when it passes.
//!
//! The journal's acknowledgements come back with
//! [`ControlPlane::handle_journal_durable`]: operations are numbered
//! ([`JournalSeq`], 1, 2, … in the order `poll_journal` hands them out), and
//! "durable up to N" means every append and begin numbered N or below is
//! durable (or has an outcome: a refused one is reported with
//! `handle_journal_refused` first).
//!
//! # The durability barrier
//!
//! A coordinator's region message (`CoordinatorEffect::Send`) leaves the
//! plane only once every event the coordinator persisted before it is
//! durable: a region never acts on an allocation that a crash could undo.
//! Messages behind the barrier wait in order, per entity type.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use shardline_core::cluster::{
    self as cl, ClusterConfig, ClusterEvent, ClusterNode, CurrentClusterState, DowningConfig,
    SbrConfig, SingletonCommand, StopReason,
};
use shardline_core::ids::{Address, MemberUid, RegionId, UniqueAddress};
use shardline_core::sharding::{
    CoordinatorEffect, CoordinatorEvent, CoordinatorMsg, CoordinatorSettings, CoordinatorState,
    Generation, LeastShardAllocationStrategy, MemberStatus as ShMemberStatus, MembershipEvent,
    RegionMsg, ShardCoordinator, SHARD_ID_HASH_NAME,
};
use shardline_journal::WriterEpoch;

use crate::config::NodeConfig;
use crate::envelope::{decode_frame_body, ControlFrame, FrameError, WireMember, WireRegionStats};
use crate::node::admin::{AdminAnswer, CoordinatorCommand};
use crate::node::msg::{sharding_event, ClusterView, StatsEvent};
use crate::node::MemberStatusView;
use crate::persistence::coordinator::{next_epoch, CoordinatorConfig, RecoveredCoordinator};
use crate::status::CoordinatorStatusView;

/// Most messages kept per entity type for a coordinator whose recovery
/// read is under way (count; regions register again on their own).
pub const WAITING_MAX: usize = 4096;

/// Most coordinator events replicated to the other members in one
/// `CoordinatorEvents` frame (count).
const REPLICATE_EVENTS_PER_FRAME: usize = 4096;

/// What a [`ControlPlane`] is built from.
#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    /// This member.
    pub me: UniqueAddress,
    /// The membership state machine's settings.
    pub cluster: ClusterConfig,
    /// Whether this member is its only seed (it forms its cluster at once).
    pub alone: bool,
    /// Data cores on this node (count).
    pub data_cores: usize,
    /// What the coordinator journal records and checks.
    pub journal: CoordinatorConfig,
    /// The `[coordinator]` table: rebalance and hand-off timing.
    pub coordinator: crate::config::CoordinatorConfig,
    /// `[cluster] on_join_refused`: stop, or keep asking the seeds.
    pub on_join_refused: crate::config::OnJoinRefused,
}

impl ControlPlaneConfig {
    /// The plane's settings from a node's configuration (`uid`: this
    /// incarnation's member uid, also the seed of the membership state
    /// machine's randomness).
    pub fn from_node_config(config: &NodeConfig, uid: MemberUid) -> Self {
        let me = UniqueAddress {
            address: Address(config.cluster_address.to_string().into()),
            uid,
        };
        let seeds: Vec<Address> = config
            .seed_nodes
            .iter()
            .map(|s| Address(s.to_string().into()))
            .collect();
        // A node whose only seed is itself forms its cluster at once (Akka's
        // `joinSeedNodes(self)`), instead of waiting for other seeds.
        let alone = seeds.len() == 1 && seeds[0] == me.address;
        let mut cc = ClusterConfig::new(me.address.clone(), if alone { Vec::new() } else { seeds });
        cc.failure_detector.acceptable_heartbeat_pause =
            Duration::from_millis(config.heartbeat_pause_ms);
        cc.downing = DowningConfig::SplitBrainResolver(SbrConfig::with_stable_after(
            Duration::from_millis(config.downing_stable_after_ms),
        ));
        cc.refusals_to_down = config.cluster.refusals_to_down;
        cc.refusal_probe_interval = Duration::from_millis(config.cluster.refusal_probe_interval_ms);
        cc.random_seed = uid.0;
        ControlPlaneConfig {
            me,
            cluster: cc,
            alone,
            data_cores: usize::from(config.data_cores),
            journal: CoordinatorConfig {
                number_of_shards: config.number_of_shards,
                hash_name: SHARD_ID_HASH_NAME.to_string(),
            },
            coordinator: config.coordinator.clone(),
            on_join_refused: config.cluster.on_join_refused,
        }
    }
}

/// The number of a journal operation that writes (a begin or an append),
/// 1, 2, … in the order [`ControlPlane::poll_journal`] hands them out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct JournalSeq(pub u64);

/// A control frame for another member (by cluster address).
#[derive(Debug, Clone)]
pub struct Transmit {
    /// The member's cluster address (`host:port`).
    pub to: String,
    /// The frame.
    pub frame: ControlFrame,
}

/// A message for every data core of this node.
#[derive(Debug, Clone)]
pub enum CoreCommand {
    /// A membership change for every region.
    Membership(MembershipEvent),
    /// The coordinator moved: regions register again.
    CoordinatorMoved,
    /// This member may (or may no longer) serve.
    Available(bool),
    /// Start the graceful hand-off of every region.
    GracefulShutdown,
    /// The member was downed, left or refused: stop serving.
    Stop,
}

/// A message for the data cores.
#[derive(Debug, Clone)]
pub enum ToCores {
    /// For the region of `type_name` on data core `core`.
    Region {
        /// The data core (index).
        core: u16,
        /// The entity type.
        type_name: String,
        /// The message.
        msg: RegionMsg,
    },
    /// For every data core.
    All(CoreCommand),
}

/// How a coordinator recovery read ended (fed to
/// [`ControlPlane::handle_recovered`]).
#[derive(Debug)]
pub enum Recovery {
    /// This node has no coordinator journal: the coordinator starts from
    /// the replicated copy, else empty, and persists nothing.
    NoJournal,
    /// The journal was read.
    Read(RecoveredCoordinator),
    /// The journal refused (config mismatch, unreadable): the coordinator
    /// does not start.
    Failed(String),
}

/// An operation on the coordinator journal, carried out by the driver in
/// the order handed out.
#[derive(Debug, Clone)]
pub enum JournalOp {
    /// Read `type_name`'s coordinator state; answer with
    /// [`ControlPlane::handle_recovered`] (at once or later).
    Recover {
        /// The entity type.
        type_name: String,
    },
    /// Begin a new incarnation of `type_name`'s journal with writer epoch
    /// `epoch` and takeover state `state`.
    Begin {
        /// The entity type.
        type_name: String,
        /// The new incarnation's writer epoch.
        epoch: WriterEpoch,
        /// The state the incarnation starts from.
        state: CoordinatorState,
        /// This operation's number.
        seq: JournalSeq,
    },
    /// Append one event of `type_name`'s current incarnation (never
    /// waiting for a flush).
    Append {
        /// The entity type.
        type_name: String,
        /// The incarnation's writer epoch.
        epoch: WriterEpoch,
        /// The event.
        event: CoordinatorEvent,
        /// This operation's number.
        seq: JournalSeq,
    },
    /// Save a snapshot of `type_name`'s coordinator state.
    SaveSnapshot {
        /// The entity type.
        type_name: String,
        /// The state (every event appended so far folded).
        state: CoordinatorState,
    },
    /// Forget `type_name`'s incarnation (or its recovery under way).
    End {
        /// The entity type.
        type_name: String,
    },
    /// Call [`ControlPlane::handle_journal_durable`] once operation `seq`
    /// is durable (messages wait for it).
    NotifyDurable {
        /// The operation waited for.
        seq: JournalSeq,
    },
}

/// The id of an admin or stats request made through the plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// Something the driver acts on or logs.
#[derive(Debug)]
pub enum ControlEvent {
    /// A membership event, for the node's subscribers (the initial
    /// `CurrentClusterState` is not sent: see [`ControlPlane::current_state`]).
    Cluster(ClusterEvent),
    /// Whether the node is ready (Up, every core's regions registered,
    /// their routing warm — every region knows every shard's home, or
    /// `coordinator.ready_warm_timeout_ms` passed since the rest held —
    /// and not stopped); sent on every change.
    Ready(bool),
    /// The member stops: 1 left, 2 downed, 4 refused to join (with the
    /// reason).
    Stopped {
        /// 1 left, 2 downed, 4 refused to join.
        code: u8,
        /// Why it refused to join (`code` 4).
        refusal: Option<String>,
    },
    /// This member became the oldest Up member: it establishes the
    /// cluster id when nobody told it one, and tells every member.
    OldestUp,
    /// A member told this one the cluster id (an `Identity` frame).
    ClusterIdHeard {
        /// The id.
        cluster_id: String,
    },
    /// The graceful leave ended (left, stopped, or its deadline passed).
    LeaveDone,
    /// The answer to [`ControlPlane::handle_coordinator_admin`].
    AdminAnswer {
        /// The request.
        id: RequestId,
        /// The answer.
        answer: AdminAnswer,
    },
    /// News for [`ControlPlane::handle_sharding_stats`]'s request.
    Stats {
        /// The request.
        id: RequestId,
        /// What happened.
        event: StatsEvent,
    },
    /// No more news will come for that stats request (its wait passed, or
    /// nobody was asked).
    StatsDone {
        /// The request.
        id: RequestId,
    },
    /// Another member asks for this node's region stats of `type_name`:
    /// the driver gathers them from its cores and answers `reply_to` with
    /// a `StatsReply` frame of `id`.
    StatsRequested {
        /// The asker's request id.
        id: u64,
        /// The entity type.
        type_name: String,
        /// The asker's cluster address.
        reply_to: String,
    },
}

enum LeavePhase {
    /// The cores hand off their shards until `until` (then the member
    /// leaves anyway).
    HandingOff { until: Duration },
    /// `ClusterNode::leave` was called.
    Leaving,
}

struct LeaveState {
    phase: LeavePhase,
    /// The leave is given up at this time.
    deadline: Duration,
}

/// A region message held until the events before it are durable.
struct Held {
    barrier: JournalSeq,
    to: RegionId,
    msg: RegionMsg,
}

/// The journal side of a hosted coordinator.
#[derive(Default)]
struct Hosting {
    /// The incarnation's writer epoch (`None`: no journal).
    epoch: Option<WriterEpoch>,
    /// The last journal operation of this coordinator.
    barrier: JournalSeq,
    /// Region messages waiting for the barrier they were sent behind.
    held: VecDeque<Held>,
}

/// The sans-IO control plane (see the module doc for the order of calls).
pub struct ControlPlane {
    me: UniqueAddress,
    cluster: ClusterNode,
    types: BTreeSet<String>,
    /// The types that remember their entities.
    remember: BTreeSet<String>,
    coordinators: BTreeMap<String, ShardCoordinator>,
    hosting: BTreeMap<String, Hosting>,
    /// Each type's coordinator state, replicated from the coordinator to
    /// every member (its `Persist` effects), so the next one recovers it.
    coord_state: BTreeMap<String, CoordinatorState>,
    /// Per type: messages for a coordinator whose recovery read is under
    /// way (at most [`WAITING_MAX`] each).
    waiting: BTreeMap<String, VecDeque<CoordinatorMsg>>,
    coord_status: BTreeMap<String, CoordinatorStatusView>,
    coordinator_settings: crate::config::CoordinatorConfig,
    /// Every type's `number_of_shards` (count; warm allocation's range).
    number_of_shards: u32,
    on_join_refused: crate::config::OnJoinRefused,
    singleton: bool,
    registered: Vec<bool>,
    /// Per data core: its journal did not open (see
    /// [`ControlPlane::handle_journal_failed`]).
    journal_failed: Vec<bool>,
    /// Per data core: every region knows every shard's home.
    warm: Vec<bool>,
    /// Routing was warm (or its wait ran out) once since the node started:
    /// readiness no longer waits for it (a hand-off that empties a cache
    /// entry does not make the node unready).
    warmed: bool,
    /// When readiness stops waiting for warm routing (armed once the node
    /// is Up with every region registered).
    warm_deadline: Option<Duration>,
    /// The warm wait ran out while some core's regions were not
    /// registered: the node is ready without them until they are (then a
    /// later re-registration makes it unready again, as usual).
    registration_waived: bool,
    handed_off: Vec<bool>,
    leave: Option<LeaveState>,
    last_oldest: Option<UniqueAddress>,
    available: bool,
    ready: bool,
    oldest_up: bool,
    stopped: bool,
    state: CurrentClusterState,
    next_seq: JournalSeq,
    durable: JournalSeq,
    armed: JournalSeq,
    next_request: u64,
    stats_waiters: BTreeMap<RequestId, Duration>,
    admin_waiters: BTreeMap<u64, (RequestId, Duration)>,
    transmits: VecDeque<Transmit>,
    to_cores: VecDeque<ToCores>,
    journal_ops: VecDeque<JournalOp>,
    events: VecDeque<ControlEvent>,
}

impl ControlPlane {
    /// A plane for a member that has not joined yet (it joins itself at
    /// once when it is its only seed); `now` on the driver's monotonic
    /// clock.
    pub fn new(config: ControlPlaneConfig, now: Duration) -> Self {
        let mut cluster = ClusterNode::new(config.cluster, config.me.uid, now);
        cluster.subscribe();
        if config.alone {
            cluster.join(now, config.me.address.clone());
        }
        let n = config.data_cores;
        let mut p = ControlPlane {
            me: config.me,
            cluster,
            types: BTreeSet::new(),
            remember: BTreeSet::new(),
            coordinators: BTreeMap::new(),
            hosting: BTreeMap::new(),
            coord_state: BTreeMap::new(),
            waiting: BTreeMap::new(),
            coord_status: BTreeMap::new(),
            coordinator_settings: config.coordinator,
            number_of_shards: config.journal.number_of_shards,
            on_join_refused: config.on_join_refused,
            singleton: false,
            registered: vec![false; n],
            journal_failed: vec![false; n],
            warm: vec![false; n],
            warmed: false,
            warm_deadline: None,
            registration_waived: false,
            handed_off: vec![false; n],
            leave: None,
            last_oldest: None,
            available: false,
            ready: false,
            oldest_up: false,
            stopped: false,
            state: CurrentClusterState::default(),
            next_seq: JournalSeq(0),
            durable: JournalSeq(0),
            armed: JournalSeq(0),
            next_request: 0,
            stats_waiters: BTreeMap::new(),
            admin_waiters: BTreeMap::new(),
            transmits: VecDeque::new(),
            to_cores: VecDeque::new(),
            journal_ops: VecDeque::new(),
            events: VecDeque::new(),
        };
        p.drive(now);
        p
    }

    // ----- outputs -----

    /// The next control frame to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next message for the data cores.
    pub fn poll_to_cores(&mut self) -> Option<ToCores> {
        self.to_cores.pop_front()
    }

    /// The next journal operation.
    pub fn poll_journal(&mut self) -> Option<JournalOp> {
        self.journal_ops.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<ControlEvent> {
        self.events.pop_front()
    }

    /// When [`Self::handle_timeout`] must be called next (on the driver's
    /// clock), if anything waits for time.
    pub fn poll_timeout(&self) -> Option<Duration> {
        let mut t: Option<Duration> = None;
        let mut at = |d: Option<Duration>| {
            if let Some(d) = d {
                t = Some(t.map_or(d, |t| t.min(d)));
            }
        };
        if !self.stopped {
            at(self.cluster.poll_timeout());
        }
        for c in self.coordinators.values() {
            at(c.poll_timeout());
        }
        if let Some(l) = &self.leave {
            at(Some(l.deadline));
            if let LeavePhase::HandingOff { until } = l.phase {
                at(Some(until));
            }
        }
        // The warm wait only ends while the rest of readiness holds (see
        // `drive`).
        if !self.warmed && !self.types.is_empty() && self.ready_but_routing() {
            at(self.warm_deadline);
        }
        at(self.stats_waiters.values().min().copied());
        at(self.admin_waiters.values().map(|(_, d)| *d).min());
        t
    }

    // ----- views -----

    /// The membership state as this member's subscribers see it.
    pub fn current_state(&self) -> &CurrentClusterState {
        &self.state
    }

    /// Whether the member stopped (left, downed or refused).
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Whether this member is Up.
    pub fn is_up(&self) -> bool {
        self.cluster
            .self_member()
            .is_some_and(|m| m.status == cl::MemberStatus::Up)
    }

    /// The membership and coordinator part of a status answer (the
    /// driver fills in the cluster's name and id, the journal identity and
    /// the journal's health).
    pub fn view(&self) -> ClusterView {
        let st = self.cluster.current_state();
        let g = self.cluster.gossip();
        let mut members: Vec<MemberStatusView> = g
            .members
            .values()
            .map(|m| MemberStatusView {
                address: m.unique_address.address.0.to_string(),
                uid: m.unique_address.uid.0,
                status: format!("{:?}", m.status),
                reachable: !st.unreachable.contains(&m.unique_address),
            })
            .collect();
        members.sort_by(|a, b| a.address.cmp(&b.address));
        ClusterView {
            members,
            leader: self.cluster.leader().map(|l| l.address.0.to_string()),
            coordinator: self.cluster.oldest().map(|o| o.address.0.to_string()),
            coordinator_here: self.singleton,
            coordinators: self
                .coord_status
                .values()
                .map(|s| {
                    let mut s = s.clone();
                    if let Some(c) = self.coordinators.get(&s.type_name) {
                        s.shards = c.state().shards.len() as u64;
                    }
                    s
                })
                .collect(),
            cluster_name: String::new(),
            cluster_id: None,
            journal_identity: String::new(),
        }
    }

    /// The membership state machine (read only: members, gossip,
    /// fencing), for views and checks.
    pub fn cluster(&self) -> &ClusterNode {
        &self.cluster
    }

    /// The hosted coordinator of `type_name`, if it runs here (not while
    /// its recovery read is under way).
    pub fn coordinator(&self, type_name: &str) -> Option<&ShardCoordinator> {
        self.coordinators.get(type_name)
    }

    // ----- inputs -----

    /// A control frame's body (the rkyv archive after the length prefix)
    /// arrived on a control lane.
    ///
    /// # Errors
    /// [`FrameError`] when the body is not a valid frame or its membership
    /// message does not decode: the driver closes that lane; the plane is
    /// unchanged.
    pub fn handle_control_frame(&mut self, now: Duration, body: &[u8]) -> Result<(), FrameError> {
        let f: ControlFrame = decode_frame_body(body)?;
        self.handle_frame(now, f)
    }

    /// A decoded control frame arrived.
    ///
    /// # Errors
    /// [`FrameError::Invalid`] when a membership message or a region
    /// message in it does not decode.
    pub fn handle_frame(&mut self, now: Duration, f: ControlFrame) -> Result<(), FrameError> {
        match f {
            ControlFrame::Cluster { bytes } => {
                let m = cl::decode(&bytes).map_err(|e| FrameError::Invalid(e.to_string()))?;
                self.cluster.handle_message(now, m);
            }
            ControlFrame::ToCoordinator { type_name, msg } => {
                if self.singleton {
                    self.coordinator_message(now, &type_name, msg.into());
                }
            }
            ControlFrame::CoordinatorEvents {
                type_name,
                reset,
                events,
            } => {
                let st = self.coord_state.entry(type_name).or_default();
                if reset {
                    *st = CoordinatorState::default();
                }
                for e in events {
                    st.apply(&CoordinatorEvent::from(e));
                }
            }
            ControlFrame::ToRegion { type_name, to, msg } => {
                let to: RegionId = to.into();
                if to.member == self.me {
                    let msg: RegionMsg = msg.try_into()?;
                    self.to_cores.push_back(ToCores::Region {
                        core: to.core,
                        type_name,
                        msg,
                    });
                }
            }
            ControlFrame::StatsRequest {
                id,
                type_name,
                reply_to,
            } => self.events.push_back(ControlEvent::StatsRequested {
                id,
                type_name,
                reply_to,
            }),
            ControlFrame::Identity { cluster_id } => self
                .events
                .push_back(ControlEvent::ClusterIdHeard { cluster_id }),
            ControlFrame::StatsReply {
                id,
                member,
                regions,
            } => {
                let id = RequestId(id);
                if self.stats_waiters.contains_key(&id) {
                    self.events.push_back(ControlEvent::Stats {
                        id,
                        event: StatsEvent::Answer(member_stats(member, regions)),
                    });
                }
            }
            ControlFrame::CoordinatorAdminRequest {
                id,
                rebalance,
                type_name,
                reply_to,
            } => {
                let cmd = if rebalance {
                    CoordinatorCommand::Rebalance { type_name }
                } else {
                    CoordinatorCommand::Allocation
                };
                let (status, body) = match self.admin_here(now, &cmd) {
                    Ok(json) => (crate::envelope::Status::Ok as u8, json),
                    Err((st, why)) => (st as u8, why.into_bytes()),
                };
                self.send_control(
                    &reply_to,
                    ControlFrame::CoordinatorAdminReply { id, status, body },
                );
            }
            ControlFrame::CoordinatorAdminReply { id, status, body } => {
                if let Some((rid, _)) = self.admin_waiters.remove(&id) {
                    let answer = match crate::envelope::Status::from_u8(status) {
                        Some(crate::envelope::Status::Ok) => Ok(body),
                        st => Err((
                            st.unwrap_or(crate::envelope::Status::EntityFailed),
                            String::from_utf8_lossy(&body).into_owned(),
                        )),
                    };
                    self.events
                        .push_back(ControlEvent::AdminAnswer { id: rid, answer });
                }
            }
        }
        self.drive(now);
        Ok(())
    }

    /// The connect to `addr` was refused (ECONNREFUSED or a reset while
    /// connecting): the membership state machine decides what that means.
    pub fn handle_connection_refused(&mut self, now: Duration, addr: &str) {
        if self.stopped {
            return;
        }
        tracing::debug!(peer = addr, "cluster port refused the connection");
        self.cluster
            .handle_connection_refused(now, &Address(addr.to_string().into()));
        self.drive(now);
    }

    /// An established control lane to `addr` was closed by the peer.
    pub fn handle_connection_lost(&mut self, now: Duration, addr: &str) {
        if self.stopped {
            return;
        }
        self.cluster
            .handle_connection_lost(now, &Address(addr.to_string().into()));
        self.drive(now);
    }

    /// The member at `addr` refused this node at the handshake with
    /// `reason`: when it is a seed and this node is not a member yet, this
    /// node will not form a cluster of its own (see
    /// `ClusterNode::handle_seed_refused`), and stops when
    /// `on_join_refused` says so.
    pub fn handle_seed_refused(&mut self, now: Duration, addr: &str, reason: &str) {
        let seed = Address(addr.to_string().into());
        let before = self.cluster.join_refused().map(str::to_string);
        self.cluster.handle_seed_refused(now, &seed, reason);
        let after = self.cluster.join_refused().map(str::to_string);
        if after.is_some() && after != before && !self.stopped {
            if self.on_join_refused == crate::config::OnJoinRefused::Exit {
                tracing::error!(
                    seed = addr,
                    reason,
                    "refused by a seed node; stopping (cluster.on_join_refused = \"exit\")"
                );
                self.refuse_to_join(format!("refused by seed node {addr}: {reason}"));
            } else {
                tracing::error!(
                    seed = addr,
                    reason,
                    "refused by a seed node; this node will not form a cluster of its own and keeps asking the seeds"
                );
            }
        }
        self.drive(now);
    }

    /// The cluster this node reached is not its own (another cluster id,
    /// or no shared journal): a node that is not Up yet stops instead of
    /// joining; a member that is Up only logs `reason`.
    pub fn handle_refuse_to_join(&mut self, now: Duration, reason: String) {
        self.refuse_to_join(reason);
        self.drive(now);
    }

    /// A data core's region sent its type's coordinator `msg`.
    pub fn handle_to_coordinator(&mut self, now: Duration, type_name: &str, msg: CoordinatorMsg) {
        if self.singleton {
            self.coordinator_message(now, type_name, msg);
        } else {
            match self.cluster.oldest() {
                Some(o) if o != self.me => {
                    let f = ControlFrame::ToCoordinator {
                        type_name: type_name.to_string(),
                        msg: (&msg).into(),
                    };
                    self.send_control(&o.address.0, f);
                }
                // No coordinator yet (or it is starting here): the region retries.
                _ => {}
            }
        }
        self.drive(now);
    }

    /// A data core's region sent the region `to` of `type_name` `msg`.
    pub fn handle_to_region(
        &mut self,
        now: Duration,
        type_name: &str,
        to: RegionId,
        msg: RegionMsg,
    ) {
        self.send_region(type_name, to, msg);
        self.drive(now);
    }

    /// An entity type was started on this node (`remember_entities`: its
    /// coordinator allocates shards that lost their home again at once).
    pub fn handle_register_type(
        &mut self,
        now: Duration,
        type_name: &str,
        remember_entities: bool,
    ) {
        if remember_entities {
            self.remember.insert(type_name.to_string());
        }
        if self.types.insert(type_name.to_string()) && self.singleton {
            if self.runs_coordinator(type_name) {
                // Started already for the other members that run the type
                // (`coordinator_for_a_type_not_started_here`): it goes on,
                // with the settings it started with until it moves.
                if remember_entities {
                    tracing::warn!(
                        type_name,
                        "entity type started here after its coordinator started for other members: \
                         the coordinator remembers no entities until it moves"
                    );
                }
            } else {
                self.new_coordinator(type_name);
            }
        }
        self.drive(now);
    }

    /// Data core `core`'s regions are (`all`) or are no longer all
    /// registered with their coordinators, and do (`warm`) or do not all
    /// know every shard's home.
    pub fn handle_registered(&mut self, now: Duration, core: u16, all: bool, warm: bool) {
        if let Some(r) = self.registered.get_mut(usize::from(core)) {
            *r = all;
        }
        if let Some(w) = self.warm.get_mut(usize::from(core)) {
            *w = warm;
        }
        self.drive(now);
    }

    /// Data core `core`'s journal did not open: the node is not ready
    /// (the stdout ready line, [`ControlEvent::Ready`]) while it is so,
    /// the condition `/health/ready` also checks; a core's journal opens
    /// once, at its start.
    pub fn handle_journal_failed(&mut self, now: Duration, core: u16) {
        if let Some(f) = self.journal_failed.get_mut(usize::from(core)) {
            *f = true;
        }
        self.drive(now);
    }

    /// Data core `core` finished its graceful hand-off: once every core
    /// did, the member leaves the cluster.
    pub fn handle_shutdown_complete(&mut self, now: Duration, core: u16) {
        if let Some(r) = self.handed_off.get_mut(usize::from(core)) {
            *r = true;
        }
        let all = self.handed_off.iter().all(|d| *d);
        let handing = self
            .leave
            .as_ref()
            .is_some_and(|l| matches!(l.phase, LeavePhase::HandingOff { .. }));
        if all && handing {
            tracing::info!("shards handed off");
            self.begin_leave(now);
        }
        self.drive(now);
    }

    /// Leave gracefully: the cores hand their shards off for half of
    /// `timeout`, then the member leaves the cluster (at once when every
    /// core finished before); [`ControlEvent::LeaveDone`] once it left or
    /// `timeout` passed.
    pub fn handle_leave(&mut self, now: Duration, timeout: Duration) {
        if self.stopped {
            self.events.push_back(ControlEvent::LeaveDone);
            return;
        }
        tracing::info!("graceful leave: handing off shards");
        self.leave = Some(LeaveState {
            phase: LeavePhase::HandingOff {
                until: now + timeout / 2,
            },
            deadline: now + timeout,
        });
        self.handed_off.iter_mut().for_each(|d| *d = false);
        self.to_cores
            .push_back(ToCores::All(CoreCommand::GracefulShutdown));
        self.drive(now);
    }

    /// A coordinator admin command: answered here when the coordinators
    /// run here, else forwarded to the oldest member (answered
    /// `Unavailable` when there is none, or after
    /// [`crate::node::admin::FORWARD_TIMEOUT`] without its answer). The
    /// answer comes as [`ControlEvent::AdminAnswer`] with the returned id.
    pub fn handle_coordinator_admin(
        &mut self,
        now: Duration,
        cmd: CoordinatorCommand,
    ) -> RequestId {
        let id = self.next_request_id();
        match self.cluster.oldest() {
            Some(o) if !self.singleton && o != self.me => {
                self.admin_waiters
                    .insert(id.0, (id, now + crate::node::admin::FORWARD_TIMEOUT));
                let (rebalance, type_name) = match cmd {
                    CoordinatorCommand::Allocation => (false, None),
                    CoordinatorCommand::Rebalance { type_name } => (true, type_name),
                };
                let f = ControlFrame::CoordinatorAdminRequest {
                    id: id.0,
                    rebalance,
                    type_name,
                    reply_to: self.me.address.0.to_string(),
                };
                self.send_control(&o.address.0, f);
            }
            _ => {
                let answer = self.admin_here(now, &cmd);
                self.events
                    .push_back(ControlEvent::AdminAnswer { id, answer });
            }
        }
        self.drive(now);
        id
    }

    /// Cluster-wide sharding stats of `type_name`: every other Up member
    /// that is reachable is asked; [`ControlEvent::Stats`] reports who was
    /// asked, then their answers for `wait`, then
    /// [`ControlEvent::StatsDone`].
    pub fn handle_sharding_stats(
        &mut self,
        now: Duration,
        type_name: String,
        wait: Duration,
    ) -> RequestId {
        let unreachable_set = &self.cluster.current_state().unreachable;
        let mut asked = Vec::new();
        let mut unreachable = Vec::new();
        for m in self.cluster.gossip().members.values() {
            if m.status != cl::MemberStatus::Up || m.unique_address == self.me {
                continue;
            }
            let who = (
                m.unique_address.address.0.to_string(),
                m.unique_address.uid.0,
            );
            if unreachable_set.contains(&m.unique_address) {
                unreachable.push(who);
            } else {
                asked.push(who);
            }
        }
        let id = self.next_request_id();
        let frame = ControlFrame::StatsRequest {
            id: id.0,
            type_name,
            reply_to: self.me.address.0.to_string(),
        };
        for (addr, _) in &asked {
            self.send_control(addr, frame.clone());
        }
        let none = asked.is_empty();
        self.events.push_back(ControlEvent::Stats {
            id,
            event: StatsEvent::Asked { asked, unreachable },
        });
        if none {
            self.events.push_back(ControlEvent::StatsDone { id });
        } else {
            self.stats_waiters.insert(id, now + wait);
        }
        id
    }

    /// A coordinator recovery read that [`JournalOp::Recover`] started
    /// ended. `wall_clock_ms` (milliseconds since the Unix epoch, read by
    /// the driver) floors the new incarnation's writer epoch and the
    /// coordinator's generations, so a cluster whose coordinator journals
    /// are gone never reuses an epoch below the ones its durable entities
    /// already wrote with.
    ///
    /// Where the state comes from: the journal when one holds the type,
    /// else the copy replicated to this member, else empty. The writer
    /// epoch: the one the recovery claimed (the database), else
    /// `next_epoch(highest recorded, wall_clock_ms)`.
    pub fn handle_recovered(
        &mut self,
        now: Duration,
        wall_clock_ms: u64,
        type_name: &str,
        recovery: Recovery,
    ) {
        let Some(msgs) = self.waiting.remove(type_name) else {
            tracing::debug!(
                type_name,
                "recovery outcome for a coordinator not starting here"
            );
            return;
        };
        self.start_coordinator(now, wall_clock_ms, type_name, recovery);
        if self.coordinators.contains_key(type_name) {
            for m in msgs {
                if let Some(c) = self.coordinators.get_mut(type_name) {
                    c.handle_message(now, m);
                }
            }
        }
        self.drive(now);
    }

    /// The journal refused `type_name`'s begin or an append with `reason`
    /// (a newer incarnation fenced it, or the journal failed): its
    /// coordinator stops and its held messages are dropped.
    pub fn handle_journal_refused(&mut self, now: Duration, type_name: &str, reason: String) {
        self.fail_coordinator(type_name, reason);
        self.drive(now);
    }

    /// Every journal operation numbered `seq` or below is durable (or had
    /// its outcome reported): the held messages behind it go.
    pub fn handle_journal_durable(&mut self, now: Duration, seq: JournalSeq) {
        if seq <= self.durable {
            return;
        }
        self.durable = seq;
        self.release_held();
        self.drive(now);
    }

    /// The journal wants a snapshot of `type_name`: queues
    /// [`JournalOp::SaveSnapshot`] with its coordinator's state.
    pub fn handle_snapshot_due(&mut self, type_name: &str) {
        let journaled = self
            .hosting
            .get(type_name)
            .is_some_and(|h| h.epoch.is_some());
        if let (true, Some(c)) = (journaled, self.coordinators.get(type_name)) {
            self.journal_ops.push_back(JournalOp::SaveSnapshot {
                type_name: type_name.to_string(),
                state: c.state().clone(),
            });
        }
    }

    /// Time passed: membership timers, coordinator timers (rebalance,
    /// hand-off and re-register timeouts), the leave's phases and the
    /// requests' expiries.
    pub fn handle_timeout(&mut self, now: Duration) {
        if !self.stopped && self.cluster.poll_timeout().is_some_and(|t| t <= now) {
            self.cluster.handle_timeout(now);
        }
        for (t, c) in self.coordinators.iter_mut() {
            if c.poll_timeout().is_none_or(|d| d > now) {
                continue;
            }
            c.handle_timeout(now);
            for a in c.take_abandoned_hand_offs() {
                tracing::warn!(
                    type_name = t,
                    shard = a.shard.0,
                    owner = %a.owner,
                    generation = a.generation.0,
                    reason = a.reason,
                    "hand-off abandoned; the shard stays with its owner"
                );
            }
        }
        if let Some(LeavePhase::HandingOff { until }) = self.leave.as_ref().map(|l| &l.phase) {
            if now >= *until {
                tracing::warn!("hand-off did not finish in time; leaving anyway");
                self.begin_leave(now);
            }
        }
        let expired: Vec<RequestId> = self
            .stats_waiters
            .iter()
            .filter(|(_, until)| now >= **until)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.stats_waiters.remove(&id);
            self.events.push_back(ControlEvent::StatsDone { id });
        }
        let expired: Vec<u64> = self
            .admin_waiters
            .iter()
            .filter(|(_, (_, until))| now >= *until)
            .map(|(id, _)| *id)
            .collect();
        for k in expired {
            if let Some((id, _)) = self.admin_waiters.remove(&k) {
                let oldest = self.cluster.oldest().map(|o| o.address.0.to_string());
                self.events.push_back(ControlEvent::AdminAnswer {
                    id,
                    answer: Err((
                        crate::envelope::Status::Unavailable,
                        format!(
                            "the coordinator's member {} did not answer within {} ms",
                            oldest.as_deref().unwrap_or("(none)"),
                            crate::node::admin::FORWARD_TIMEOUT.as_millis()
                        ),
                    )),
                });
            }
        }
        if self.leave.as_ref().is_some_and(|l| now >= l.deadline) {
            self.leave = None;
            tracing::warn!("leave did not complete in time");
            self.events.push_back(ControlEvent::LeaveDone);
        }
        self.drive(now);
    }

    // ----- internals -----

    fn next_request_id(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.next_request)
    }

    fn send_control(&mut self, to: &str, frame: ControlFrame) {
        if to == &*self.me.address.0 {
            return;
        }
        self.transmits.push_back(Transmit {
            to: to.to_string(),
            frame,
        });
    }

    fn tell_all_cores(&mut self, c: CoreCommand) {
        self.to_cores.push_back(ToCores::All(c));
    }

    /// Carries out every pending effect of the membership state machine and
    /// the coordinators (bounded: stops when a round produced nothing).
    fn drive(&mut self, now: Duration) {
        for _ in 0..64 {
            let mut progressed = false;
            self.check_oldest_up();
            if let Some(reason) = self.cluster.poll_stop() {
                progressed = true;
                self.on_stop(reason);
            }
            while let Some(cmd) = self.cluster.poll_singleton() {
                progressed = true;
                match cmd {
                    SingletonCommand::Start => self.start_coordinators(),
                    SingletonCommand::Stop => {
                        self.stop_coordinators();
                        self.cluster.handle_singleton_stopped(now);
                    }
                }
            }
            while let Some(t) = self.cluster.poll_transmit() {
                progressed = true;
                let bytes = cl::encode(&t.message);
                self.send_control(&t.to.0, ControlFrame::Cluster { bytes });
            }
            while let Some(e) = self.cluster.poll_event() {
                progressed = true;
                self.on_cluster_event(now, e);
            }
            let types: Vec<String> = self.coordinators.keys().cloned().collect();
            for t in types {
                progressed |= self.drain_coordinator(&t);
            }
            if !progressed {
                break;
            }
        }
        let oldest = self.cluster.oldest();
        if oldest != self.last_oldest {
            tracing::info!(oldest = ?oldest.as_ref().map(|o| o.to_string()), "coordinator location changed");
            self.last_oldest = oldest;
            self.tell_all_cores(CoreCommand::CoordinatorMoved);
        }
        let avail = self.cluster.is_available();
        if avail != self.available {
            self.available = avail;
            self.tell_all_cores(CoreCommand::Available(avail));
        }
        // A node without entity types (a pure routing node) has nothing to
        // register or warm: it is ready once Up. Otherwise readiness waits
        // for every region's registration and warm routing, at most
        // `coordinator.ready_warm_timeout_ms` after the rest holds.
        let base = self.ready_but_routing();
        let nothing_to_route = self.types.is_empty();
        let registered = self.registered.iter().all(|r| *r);
        if registered {
            self.registration_waived = false;
        }
        if base && !nothing_to_route && !self.warmed {
            if registered && self.warm.iter().all(|w| *w) {
                self.warmed = true;
                tracing::info!("routing is warm: every region knows every shard's home");
            } else {
                let deadline = *self
                    .warm_deadline
                    .get_or_insert(now + self.coordinator_settings.ready_warm_timeout());
                if now >= deadline {
                    self.warmed = true;
                    self.registration_waived = !registered;
                    self.warn_ready_without_warm_routing();
                }
            }
        }
        let ready =
            base && (nothing_to_route || (self.warmed && (registered || self.registration_waived)));
        if ready != self.ready {
            self.ready = ready;
            self.events.push_back(ControlEvent::Ready(ready));
        }
    }

    /// The `ready without warm routing` warning: which cores' regions are
    /// not registered with their coordinators or do not know every
    /// shard's home, this node's types, and where their coordinators run.
    fn warn_ready_without_warm_routing(&self) {
        let unregistered: Vec<usize> = (0..self.registered.len())
            .filter(|c| !self.registered[*c])
            .collect();
        let cold: Vec<usize> = (0..self.warm.len()).filter(|c| !self.warm[*c]).collect();
        let coordinator = self
            .cluster
            .oldest()
            .map_or_else(|| "-".to_string(), |o| o.address.0.to_string());
        tracing::warn!(
            unregistered_cores = ?unregistered,
            cold_cores = ?cold,
            types = ?self.types,
            coordinator,
            timeout_ms = self.coordinator_settings.ready_warm_timeout_ms,
            "ready without warm routing: within coordinator.ready_warm_timeout_ms the regions of \
             unregistered_cores got no answer to their registration and those of cold_cores do not \
             know every shard's home (is the coordinator, on the oldest member, slow or unreachable?); \
             their first requests ask the coordinator"
        );
    }

    /// Readiness but for the regions' registration and warm routing: Up,
    /// every core's journal open, and not stopped.
    fn ready_but_routing(&self) -> bool {
        self.is_up() && !self.journal_failed.iter().any(|f| *f) && !self.stopped
    }

    /// Reports [`ControlEvent::OldestUp`] when this member became the
    /// oldest Up member.
    fn check_oldest_up(&mut self) {
        let now_oldest =
            !self.stopped && self.is_up() && self.cluster.oldest().as_ref() == Some(&self.me);
        if now_oldest && !self.oldest_up {
            self.events.push_back(ControlEvent::OldestUp);
        }
        self.oldest_up = now_oldest;
    }

    fn refuse_to_join(&mut self, reason: String) {
        if self.stopped {
            return;
        }
        if self.is_up() {
            tracing::error!(reason, "refused by a member");
            return;
        }
        tracing::error!(reason, "refusing to join the cluster; stopping");
        self.stopped = true;
        self.stop_coordinators();
        self.tell_all_cores(CoreCommand::Stop);
        self.events.push_back(ControlEvent::Stopped {
            code: 4,
            refusal: Some(reason),
        });
        if self.leave.take().is_some() {
            self.events.push_back(ControlEvent::LeaveDone);
        }
    }

    fn on_stop(&mut self, reason: StopReason) {
        self.stopped = true;
        let code = match reason {
            StopReason::Left => 1,
            _ => 2,
        };
        match reason {
            StopReason::Left => tracing::info!("left the cluster"),
            _ => tracing::error!(?reason, "this member was downed; stopping"),
        }
        self.stop_coordinators();
        self.tell_all_cores(CoreCommand::Stop);
        self.events.push_back(ControlEvent::Stopped {
            code,
            refusal: None,
        });
        if self.leave.take().is_some() {
            self.events.push_back(ControlEvent::LeaveDone);
        }
    }

    fn on_cluster_event(&mut self, now: Duration, e: ClusterEvent) {
        self.state.apply(&e);
        tracing::info!(event = ?short_event(&e), "cluster event");
        if let ClusterEvent::MemberUp(m) = &e {
            if self.singleton && m.unique_address != self.me {
                let addr = m.unique_address.address.0.to_string();
                self.send_coordinator_snapshot(&addr);
            }
        }
        if let Some(me) = sharding_event(&e) {
            for c in self.coordinators.values_mut() {
                c.handle_membership(now, me.clone());
            }
            self.tell_all_cores(CoreCommand::Membership(me));
        }
        // Subscribers get their own snapshot when they subscribe
        // (`current_state`), then every change.
        if !matches!(e, ClusterEvent::CurrentClusterState(_)) {
            self.events.push_back(ControlEvent::Cluster(e));
        }
    }

    fn current_members(&self) -> MembershipEvent {
        let list = self
            .state
            .members
            .values()
            .filter_map(|m| match m.status {
                cl::MemberStatus::Up => Some((m.unique_address.clone(), ShMemberStatus::Up)),
                cl::MemberStatus::Leaving | cl::MemberStatus::Exiting | cl::MemberStatus::Down => {
                    Some((m.unique_address.clone(), ShMemberStatus::Leaving))
                }
                _ => None,
            })
            .collect();
        MembershipEvent::CurrentMembers(list)
    }

    fn start_coordinators(&mut self) {
        self.check_oldest_up();
        tracing::info!("coordinator singleton starts here");
        self.singleton = true;
        let types: Vec<String> = self.types.iter().cloned().collect();
        for t in types {
            self.new_coordinator(&t);
        }
        // Regions (here and elsewhere) register again with the new coordinator.
        self.tell_all_cores(CoreCommand::CoordinatorMoved);
    }

    fn stop_coordinators(&mut self) {
        if self.singleton {
            tracing::info!("coordinator singleton stops here");
        }
        self.singleton = false;
        let ended: BTreeSet<String> = self
            .coordinators
            .keys()
            .chain(self.waiting.keys())
            .cloned()
            .collect();
        for type_name in ended {
            self.journal_ops.push_back(JournalOp::End { type_name });
        }
        self.waiting.clear();
        self.coordinators.clear();
        self.hosting.clear();
        self.coord_status.clear();
    }

    /// Starts recovering `t`'s coordinator: it starts in
    /// [`Self::handle_recovered`], never before; messages for it wait.
    fn new_coordinator(&mut self, t: &str) {
        self.waiting.entry(t.to_string()).or_default();
        self.coord_status.insert(
            t.to_string(),
            CoordinatorStatusView {
                type_name: t.to_string(),
                writer_epoch: 0,
                recovered_from: "recovering".to_string(),
                journal_dir: None,
                recovered_records: 0,
                recovered_shards: 0,
                shards: 0,
                refused: None,
                journal_error: None,
            },
        );
        self.journal_ops.push_back(JournalOp::Recover {
            type_name: t.to_string(),
        });
    }

    /// Hands `msg` to `t`'s coordinator, or keeps it while its recovery is
    /// under way (the oldest goes beyond [`WAITING_MAX`]).
    ///
    /// A message for a type this node never started (the type is started
    /// on other members only, while its coordinator runs on the oldest
    /// member, this one) starts a coordinator for it here, with this
    /// node's coordinator settings and without `remember_entities` (the
    /// region's messages do not carry it), once per singleton incarnation
    /// (see [`Self::coordinator_for_a_type_not_started_here`]).
    fn coordinator_message(&mut self, now: Duration, t: &str, msg: CoordinatorMsg) {
        if self.singleton
            && !self.types.contains(t)
            && !self.coord_status.contains_key(t)
            && !self.runs_coordinator(t)
        {
            self.coordinator_for_a_type_not_started_here(t);
        }
        if let Some(c) = self.coordinators.get_mut(t) {
            c.handle_message(now, msg);
        } else if let Some(q) = self.waiting.get_mut(t) {
            if q.len() >= WAITING_MAX {
                q.pop_front();
            }
            q.push_back(msg);
        }
    }

    /// Whether `t`'s coordinator runs here or is recovering its state.
    fn runs_coordinator(&self, t: &str) -> bool {
        self.coordinators.contains_key(t) || self.waiting.contains_key(t)
    }

    /// Starts `t`'s coordinator on this node, the oldest member, which
    /// never started the type (another member's region asked for it), and
    /// says so: in Akka the coordinator singleton of a type runs on the
    /// oldest node where the type's sharding is started (roles say which);
    /// here it runs on the oldest member, so that member hosts it for
    /// types started elsewhere only.
    fn coordinator_for_a_type_not_started_here(&mut self, t: &str) {
        tracing::warn!(
            type_name = t,
            "entity type {t} is not started on this node, the oldest member, where the coordinators \
             run: its coordinator starts here for the members that started it, with this node's \
             [coordinator] settings and without remember_entities; this node hosts none of its \
             shards and refuses its requests (UnknownEntityType). Start every entity type on every \
             node (start_proxy where a node should host none of its entities)"
        );
        self.new_coordinator(t);
    }

    fn start_coordinator(&mut self, now: Duration, wall_clock_ms: u64, t: &str, rec: Recovery) {
        let mut status = CoordinatorStatusView {
            type_name: t.to_string(),
            writer_epoch: 0,
            recovered_from: "empty".to_string(),
            journal_dir: None,
            recovered_records: 0,
            recovered_shards: 0,
            shards: 0,
            refused: None,
            journal_error: None,
        };
        let replicated = self.coord_state.get(t).cloned();
        let mut state = CoordinatorState::default();
        let mut hosting = Hosting::default();
        match rec {
            Recovery::Failed(e) => {
                tracing::error!(type_name = t, error = %e, "coordinator refused to start");
                status.refused = Some(e);
                self.coord_status.insert(t.to_string(), status);
                return;
            }
            Recovery::Read(rec) => {
                if let Some(dir) = &rec.source {
                    status.recovered_from = if rec.from_database {
                        "database".to_string()
                    } else {
                        "journal".to_string()
                    };
                    status.journal_dir = Some(dir.display().to_string());
                    status.recovered_records = rec.records;
                    state = rec.state;
                } else if let Some(r) = replicated {
                    status.recovered_from = "replicated".to_string();
                    state = r;
                }
                let epoch = rec
                    .claimed_epoch
                    .unwrap_or_else(|| next_epoch(rec.highest_epoch, wall_clock_ms));
                self.next_seq.0 += 1;
                let seq = self.next_seq;
                self.journal_ops.push_back(JournalOp::Begin {
                    type_name: t.to_string(),
                    epoch,
                    state: state.clone(),
                    seq,
                });
                hosting.epoch = Some(epoch);
                hosting.barrier = seq;
                status.writer_epoch = epoch.0;
            }
            Recovery::NoJournal => {
                if let Some(r) = replicated {
                    status.recovered_from = "replicated".to_string();
                    state = r;
                }
            }
        }
        status.recovered_shards = state.shards.len() as u64;
        tracing::info!(
            type_name = t,
            writer_epoch = status.writer_epoch,
            from = %status.recovered_from,
            dir = status.journal_dir.as_deref().unwrap_or("-"),
            records = status.recovered_records,
            shards = status.recovered_shards,
            "coordinator recovered"
        );
        // Members' replicated copies follow the recovered state.
        self.coord_state.insert(t.to_string(), state.clone());
        let cc = &self.coordinator_settings;
        let settings = CoordinatorSettings {
            min_generation: Generation(wall_clock_ms),
            remember_entities: self.remember.contains(t),
            rebalance_interval: cc.rebalance_interval(),
            handoff_timeout: cc.handoff_timeout(),
            reregister_timeout: cc.reregister_timeout(),
            min_nr_of_members: cc.min_nr_of_members,
            number_of_shards: if cc.warm_allocation {
                self.number_of_shards
            } else {
                0
            },
            warm_settle: CoordinatorSettings::default().warm_settle,
        };
        let strategy = LeastShardAllocationStrategy {
            rebalance_absolute_limit: cc.rebalance_absolute_limit,
            rebalance_relative_limit: cc.rebalance_relative_limit,
        };
        let mut c = ShardCoordinator::recover_state(settings, Box::new(strategy), state, now);
        c.handle_membership(now, self.current_members());
        self.coordinators.insert(t.to_string(), c);
        self.hosting.insert(t.to_string(), hosting);
        self.coord_status.insert(t.to_string(), status);
        for addr in self.other_members() {
            self.send_coordinator_snapshot(&addr);
        }
    }

    fn fail_coordinator(&mut self, t: &str, reason: String) {
        tracing::error!(
            type_name = t,
            reason,
            "coordinator stops: its journal refused an event"
        );
        let ran = self.coordinators.remove(t).is_some() | self.hosting.remove(t).is_some();
        if ran {
            self.journal_ops.push_back(JournalOp::End {
                type_name: t.to_string(),
            });
        }
        if let Some(st) = self.coord_status.get_mut(t) {
            st.refused = Some(reason);
        }
    }

    /// Sends the held region messages whose barrier is durable.
    fn release_held(&mut self) {
        let durable = self.durable;
        let mut ready = Vec::new();
        for (t, h) in self.hosting.iter_mut() {
            let n = h.held.iter().take_while(|m| m.barrier <= durable).count();
            ready.extend(h.held.drain(..n).map(|m| (t.clone(), m.to, m.msg)));
        }
        for (t, to, msg) in ready {
            self.send_region(&t, to, msg);
        }
        self.arm_durable();
    }

    /// Asks to be told when the newest held message may go.
    fn arm_durable(&mut self) {
        let want = self
            .hosting
            .values()
            .filter_map(|h| h.held.back().map(|m| m.barrier))
            .max()
            .unwrap_or_default();
        if want <= self.durable || want <= self.armed {
            return;
        }
        self.armed = want;
        self.journal_ops
            .push_back(JournalOp::NotifyDurable { seq: want });
    }

    /// Carries out `t`'s coordinator effects: events are appended to the
    /// journal and replicated to the other members; a region message waits
    /// until every event before it is durable.
    fn drain_coordinator(&mut self, t: &str) -> bool {
        let mut any = false;
        // Consecutive events go to the other members in one frame (a warm
        // batch is one frame, not one per shard).
        let mut replicate: Vec<crate::envelope::WireCoordinatorEvent> = Vec::new();
        loop {
            let Some(c) = self.coordinators.get_mut(t) else {
                self.replicate(t, &mut replicate);
                return any;
            };
            let Some(e) = c.poll_effect() else {
                self.replicate(t, &mut replicate);
                if self.hosting.get(t).is_some_and(|h| !h.held.is_empty()) {
                    self.arm_durable();
                }
                return any;
            };
            if matches!(e, CoordinatorEffect::Send { .. }) {
                self.replicate(t, &mut replicate);
            }
            any = true;
            let durable = self.durable;
            let h = self.hosting.entry(t.to_string()).or_default();
            match e {
                CoordinatorEffect::Send { to, msg } => {
                    if h.held.is_empty() && h.barrier <= durable {
                        self.send_region(t, to, msg);
                    } else {
                        h.held.push_back(Held {
                            barrier: h.barrier,
                            to,
                            msg,
                        });
                    }
                }
                CoordinatorEffect::Persist(ev) => {
                    if let Some(epoch) = h.epoch {
                        self.next_seq.0 += 1;
                        h.barrier = self.next_seq;
                        self.journal_ops.push_back(JournalOp::Append {
                            type_name: t.to_string(),
                            epoch,
                            event: ev.clone(),
                            seq: self.next_seq,
                        });
                    }
                    // Applied to this member's copy and queued to every
                    // other member's control lane before any later effect
                    // (FIFO lanes keep that order per member).
                    self.coord_state
                        .entry(t.to_string())
                        .or_default()
                        .apply(&ev);
                    replicate.push((&ev).into());
                    if replicate.len() >= REPLICATE_EVENTS_PER_FRAME {
                        self.replicate(t, &mut replicate);
                    }
                }
            }
        }
    }

    /// Sends `events` (emptied) of `t`'s coordinator to every other member
    /// in one frame.
    fn replicate(&mut self, t: &str, events: &mut Vec<crate::envelope::WireCoordinatorEvent>) {
        if events.is_empty() {
            return;
        }
        let f = ControlFrame::CoordinatorEvents {
            type_name: t.to_string(),
            reset: false,
            events: std::mem::take(events),
        };
        for addr in self.other_members() {
            self.send_control(&addr, f.clone());
        }
    }

    /// Cluster addresses of the other members that are alive.
    fn other_members(&self) -> Vec<String> {
        self.state
            .members
            .values()
            .filter(|m| {
                m.unique_address != self.me
                    && !matches!(m.status, cl::MemberStatus::Down | cl::MemberStatus::Removed)
            })
            .map(|m| m.unique_address.address.0.to_string())
            .collect()
    }

    /// Sends this member's copy of every coordinator state to `addr`.
    fn send_coordinator_snapshot(&mut self, addr: &str) {
        let frames: Vec<ControlFrame> = self
            .coord_state
            .iter()
            .map(|(t, st)| ControlFrame::CoordinatorEvents {
                type_name: t.clone(),
                reset: true,
                events: snapshot_events(st).iter().map(Into::into).collect(),
            })
            .collect();
        for f in frames {
            self.send_control(addr, f);
        }
    }

    fn send_region(&mut self, t: &str, to: RegionId, msg: RegionMsg) {
        if to.member == self.me {
            self.to_cores.push_back(ToCores::Region {
                core: to.core,
                type_name: t.to_string(),
                msg,
            });
        } else {
            let addr = to.member.address.0.to_string();
            let f = ControlFrame::ToRegion {
                type_name: t.to_string(),
                to: (&to).into(),
                msg: (&msg).into(),
            };
            self.send_control(&addr, f);
        }
    }

    fn begin_leave(&mut self, now: Duration) {
        if let Some(l) = &mut self.leave {
            l.phase = LeavePhase::Leaving;
        }
        if self.cluster.self_member().is_none() {
            // Never joined (e.g. refused by its seeds and still asking):
            // there is no cluster to leave, so nothing to wait for.
            tracing::info!("not a member of any cluster; stopping");
            self.on_stop(StopReason::Left);
            return;
        }
        tracing::info!("leaving the cluster");
        self.cluster.leave(now);
    }

    /// Answers `cmd` from the coordinators on this member, or says where
    /// they run.
    fn admin_here(&mut self, now: Duration, cmd: &CoordinatorCommand) -> AdminAnswer {
        if !self.singleton {
            let where_ = match self.cluster.oldest() {
                Some(o) => format!("they run on {}", o.address.0),
                None => "no member is Up".to_string(),
            };
            return Err((
                crate::envelope::Status::Unavailable,
                format!(
                    "the coordinators do not run on {}: {where_}",
                    self.me.address.0
                ),
            ));
        }
        let me = self.me.clone();
        crate::node::admin::answer(&me, now, &mut self.coordinators, cmd)
    }
}

/// A [`ControlFrame::StatsReply`] as [`crate::status::MemberShardStats`].
fn member_stats(
    member: WireMember,
    regions: Vec<WireRegionStats>,
) -> crate::status::MemberShardStats {
    crate::status::MemberShardStats {
        address: member.address,
        uid: member.uid,
        regions: regions
            .into_iter()
            .map(|r| crate::status::RegionShardStats {
                core: r.core,
                proxy: r.proxy,
                registered: r.registered,
                shards: r.shards.into_iter().collect(),
                buffered: r.buffered,
                dead_letters: r.dead_letters,
            })
            .collect(),
    }
}

/// Events whose fold is `st` (same homes, regions, proxies and
/// `last_generation`, unallocated shards), for recovering a coordinator
/// from a replicated state.
pub fn snapshot_events(st: &CoordinatorState) -> Vec<CoordinatorEvent> {
    let mut ev = Vec::new();
    let top = st
        .shards
        .values()
        .map(|(_, g)| *g)
        .max()
        .unwrap_or(Generation(0));
    if st.last_generation > top {
        // Carry the largest generation ever allocated with a placeholder
        // allocation that is undone at once (shard id outside every range).
        let phantom = RegionId {
            member: UniqueAddress {
                address: Address(String::new().into()),
                uid: MemberUid(0),
            },
            core: u16::MAX,
        };
        let shard = shardline_core::ids::ShardId(u32::MAX);
        ev.push(CoordinatorEvent::ShardHomeAllocated {
            shard,
            region: phantom.clone(),
            generation: st.last_generation,
        });
        ev.push(CoordinatorEvent::ShardHomeDeallocated {
            shard,
            generation: st.last_generation,
        });
        ev.push(CoordinatorEvent::ShardRegionTerminated { region: phantom });
    }
    for r in st.regions.keys() {
        ev.push(CoordinatorEvent::ShardRegionRegistered { region: r.clone() });
    }
    for p in &st.proxies {
        ev.push(CoordinatorEvent::ShardRegionProxyRegistered { proxy: p.clone() });
    }
    for (s, (r, g)) in &st.shards {
        ev.push(CoordinatorEvent::ShardHomeAllocated {
            shard: *s,
            region: r.clone(),
            generation: *g,
        });
    }
    for s in &st.unallocated {
        ev.push(CoordinatorEvent::ShardUnallocated { shard: *s });
    }
    ev
}

fn short_event(e: &ClusterEvent) -> String {
    match e {
        ClusterEvent::CurrentClusterState(s) => {
            format!("CurrentClusterState({} members)", s.members.len())
        }
        ClusterEvent::MemberJoined(m) => format!("MemberJoined({})", m.unique_address),
        ClusterEvent::MemberWeaklyUp(m) => format!("MemberWeaklyUp({})", m.unique_address),
        ClusterEvent::MemberUp(m) => format!("MemberUp({})", m.unique_address),
        ClusterEvent::MemberLeft(m) => format!("MemberLeft({})", m.unique_address),
        ClusterEvent::MemberExited(m) => format!("MemberExited({})", m.unique_address),
        ClusterEvent::MemberDowned(m) => format!("MemberDowned({})", m.unique_address),
        ClusterEvent::MemberRemoved { member, .. } => {
            format!("MemberRemoved({})", member.unique_address)
        }
        ClusterEvent::UnreachableMember(m) => format!("UnreachableMember({})", m.unique_address),
        ClusterEvent::ReachableMember(m) => format!("ReachableMember({})", m.unique_address),
        ClusterEvent::LeaderChanged(l) => {
            format!("LeaderChanged({:?})", l.as_ref().map(|l| l.to_string()))
        }
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::WireCoordinatorEvent;
    use crate::persistence::coordinator::RecoveredCoordinator;
    use shardline_core::ids::ShardId;

    const TYPE: &str = "counter";

    fn me() -> UniqueAddress {
        UniqueAddress {
            address: Address("127.0.0.1:27001".to_string().into()),
            uid: MemberUid(7),
        }
    }

    fn region(core: u16) -> RegionId {
        RegionId { member: me(), core }
    }

    /// A member that is its only seed, with `cores` data cores.
    fn single(cores: usize) -> ControlPlane {
        plane(cores, Vec::new(), true)
    }

    /// A member whose only seed is another address that never answers: it
    /// keeps asking and is in no cluster.
    fn never_joined(cores: usize) -> ControlPlane {
        plane(
            cores,
            vec![Address("127.0.0.1:27002".to_string().into())],
            false,
        )
    }

    fn plane(cores: usize, seeds: Vec<Address>, alone: bool) -> ControlPlane {
        let me = me();
        let cfg = ControlPlaneConfig {
            cluster: ClusterConfig::new(me.address.clone(), seeds),
            me,
            alone,
            data_cores: cores,
            journal: CoordinatorConfig {
                number_of_shards: 16,
                hash_name: SHARD_ID_HASH_NAME.to_string(),
            },
            coordinator: crate::config::CoordinatorConfig::default(),
            on_join_refused: crate::config::OnJoinRefused::default(),
        };
        ControlPlane::new(cfg, Duration::ZERO)
    }

    /// Everything the plane handed out since the last call.
    #[derive(Default)]
    struct Out {
        transmits: Vec<Transmit>,
        cores: Vec<ToCores>,
        journal: Vec<JournalOp>,
        events: Vec<ControlEvent>,
    }

    impl Out {
        fn region_msgs(&self) -> Vec<(u16, RegionMsg)> {
            self.cores
                .iter()
                .filter_map(|c| match c {
                    ToCores::Region { core, msg, .. } => Some((*core, msg.clone())),
                    ToCores::All(_) => None,
                })
                .collect()
        }
        fn begin(&self) -> Option<(WriterEpoch, CoordinatorState, JournalSeq)> {
            self.journal.iter().find_map(|j| match j {
                JournalOp::Begin {
                    epoch, state, seq, ..
                } => Some((*epoch, state.clone(), *seq)),
                _ => None,
            })
        }
        fn appends(&self) -> Vec<(CoordinatorEvent, JournalSeq)> {
            self.journal
                .iter()
                .filter_map(|j| match j {
                    JournalOp::Append { event, seq, .. } => Some((event.clone(), *seq)),
                    _ => None,
                })
                .collect()
        }
    }

    fn drain(p: &mut ControlPlane) -> Out {
        let mut o = Out::default();
        while let Some(t) = p.poll_transmit() {
            o.transmits.push(t);
        }
        while let Some(c) = p.poll_to_cores() {
            o.cores.push(c);
        }
        while let Some(j) = p.poll_journal() {
            o.journal.push(j);
        }
        while let Some(e) = p.poll_event() {
            o.events.push(e);
        }
        o
    }

    /// Advances time in 10 ms steps until `done` holds for the outputs of
    /// a step (at most `limit`); the outputs of every step, folded.
    fn run_until(
        p: &mut ControlPlane,
        now: &mut Duration,
        limit: Duration,
        mut done: impl FnMut(&ControlPlane, &Out) -> bool,
    ) -> Out {
        let end = *now + limit;
        let mut all = Out::default();
        while *now < end {
            *now += Duration::from_millis(10);
            p.handle_timeout(*now);
            let o = drain(p);
            let stop = done(p, &o);
            all.transmits.extend(o.transmits);
            all.cores.extend(o.cores);
            all.journal.extend(o.journal);
            all.events.extend(o.events);
            if stop {
                return all;
            }
        }
        panic!("nothing happened within {limit:?}");
    }

    /// A single member Up with `TYPE` registered, up to the recovery read
    /// of its coordinator.
    fn until_recover(cores: usize) -> (ControlPlane, Duration) {
        let mut p = single(cores);
        let mut now = Duration::ZERO;
        p.handle_register_type(now, TYPE, false);
        run_until(&mut p, &mut now, Duration::from_secs(20), |_, o| {
            o.journal
                .iter()
                .any(|j| matches!(j, JournalOp::Recover { type_name } if type_name == TYPE))
        });
        assert!(p.is_up());
        (p, now)
    }

    /// The coordinator's recovery read finds nothing (a new cluster).
    fn recover_empty(p: &mut ControlPlane, now: Duration) {
        p.handle_recovered(
            now,
            1_000,
            TYPE,
            Recovery::Read(RecoveredCoordinator::default()),
        );
    }

    fn register(p: &mut ControlPlane, now: Duration, core: u16) -> Out {
        p.handle_to_coordinator(
            now,
            TYPE,
            CoordinatorMsg::Register {
                region: region(core),
                hosted: Vec::new(),
                stopping: Vec::new(),
            },
        );
        drain(p)
    }

    fn state_with(shards: &[(u32, u64)]) -> CoordinatorState {
        let mut st = CoordinatorState::default();
        st.apply(&CoordinatorEvent::ShardRegionRegistered { region: region(0) });
        for (s, g) in shards {
            st.apply(&CoordinatorEvent::ShardHomeAllocated {
                shard: ShardId(*s),
                region: region(0),
                generation: Generation(*g),
            });
        }
        st
    }

    fn status(p: &ControlPlane) -> CoordinatorStatusView {
        p.view()
            .coordinators
            .into_iter()
            .find(|c| c.type_name == TYPE)
            .expect("a coordinator status")
    }

    #[test]
    fn coordinator_messages_are_held_until_the_journal_acknowledges_their_events() {
        let (mut p, now) = until_recover(1);
        recover_empty(&mut p, now);
        let o = drain(&mut p);
        let (_, _, begin) = o.begin().expect("a new incarnation begins");
        assert!(p.coordinator(TYPE).is_some());
        // The region registers: the coordinator persists its registration
        // and answers; the answer waits for both the begin and the event.
        let o = register(&mut p, now, 0);
        let appends = o.appends();
        assert!(
            matches!(appends.as_slice(), [(CoordinatorEvent::ShardRegionRegistered { .. }, s)] if *s > begin),
            "{appends:?}"
        );
        let registered = appends[0].1;
        assert!(o.region_msgs().is_empty(), "sent before durable");
        assert!(o
            .journal
            .iter()
            .any(|j| matches!(j, JournalOp::NotifyDurable { seq } if *seq == registered)));
        // A later message of the same coordinator queues behind it.
        p.handle_to_coordinator(
            now,
            TYPE,
            CoordinatorMsg::GetShardHome {
                region: region(0),
                shard: ShardId(3),
            },
        );
        let o = drain(&mut p);
        let allocated = o
            .appends()
            .into_iter()
            .find(|(e, _)| matches!(e, CoordinatorEvent::ShardHomeAllocated { .. }))
            .expect("the shard is allocated")
            .1;
        assert!(o.region_msgs().is_empty(), "sent before durable");
        // Durable up to the begin only: still held.
        p.handle_journal_durable(now, begin);
        assert!(drain(&mut p).region_msgs().is_empty());
        // Durable up to the registration: the ack goes, the home waits.
        p.handle_journal_durable(now, registered);
        let sent = drain(&mut p).region_msgs();
        assert_eq!(sent, vec![(0, RegionMsg::RegisterAck)]);
        p.handle_journal_durable(now, allocated);
        let sent = drain(&mut p).region_msgs();
        // To the home and to the asker (here the same region).
        assert!(
            !sent.is_empty()
                && sent.iter().all(|m| matches!(
                    m,
                    (
                        0,
                        RegionMsg::ShardHome {
                            shard: ShardId(3),
                            ..
                        }
                    )
                )),
            "{sent:?}"
        );
    }

    #[test]
    fn a_warm_batch_is_one_durability_round_and_ready_waits_for_warm_regions() {
        let (mut p, mut now) = until_recover(2);
        recover_empty(&mut p, now);
        drain(&mut p);
        register(&mut p, now, 0);
        register(&mut p, now, 1);
        p.handle_registered(now, 0, true, false);
        p.handle_registered(now, 1, true, false);
        assert!(
            !drain(&mut p)
                .events
                .iter()
                .any(|e| matches!(e, ControlEvent::Ready(true))),
            "ready before the regions know the homes"
        );
        // After the settle time the coordinator allocates all 16 shards at
        // once: 16 appends, one wait for durability, nothing sent before.
        let o = run_until(&mut p, &mut now, Duration::from_secs(2), |_, o| {
            o.journal.iter().any(|j| {
                matches!(
                    j,
                    JournalOp::Append {
                        event: CoordinatorEvent::ShardHomeAllocated { .. },
                        ..
                    }
                )
            })
        });
        let allocs: Vec<JournalSeq> = o
            .appends()
            .into_iter()
            .filter(|(e, _)| matches!(e, CoordinatorEvent::ShardHomeAllocated { .. }))
            .map(|(_, s)| s)
            .collect();
        assert_eq!(allocs.len(), 16);
        let last = *allocs.last().expect("allocations");
        let waits: Vec<JournalSeq> = o
            .journal
            .iter()
            .filter_map(|j| match j {
                JournalOp::NotifyDurable { seq } if *seq >= allocs[0] => Some(*seq),
                _ => None,
            })
            .collect();
        assert_eq!(waits, vec![last], "one durability round for the batch");
        assert!(!o
            .region_msgs()
            .iter()
            .any(|(_, m)| matches!(m, RegionMsg::ShardHomes { .. })));
        p.handle_journal_durable(now, last);
        let sent = drain(&mut p).region_msgs();
        for core in 0..2 {
            let homes: usize = sent
                .iter()
                .filter(|(c, _)| *c == core)
                .map(|(_, m)| match m {
                    RegionMsg::ShardHomes { homes } => homes.len(),
                    _ => 0,
                })
                .sum();
            assert_eq!(homes, 16, "core {core}: {sent:?}");
        }
        // Ready once every core reports its regions warm.
        p.handle_registered(now, 0, true, true);
        assert!(!drain(&mut p)
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::Ready(true))));
        p.handle_registered(now, 1, true, true);
        assert!(drain(&mut p)
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::Ready(true))));
        // Later cache changes (a hand-off) do not make it unready.
        p.handle_registered(now, 1, true, false);
        assert!(!drain(&mut p)
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::Ready(false))));
    }

    #[test]
    fn a_core_whose_journal_did_not_open_keeps_the_node_unready() {
        let (mut p, mut now) = until_recover(1);
        recover_empty(&mut p, now);
        drain(&mut p);
        p.handle_journal_failed(now, 0);
        p.handle_registered(now, 0, true, true);
        // Past the warm wait too: never ready, as /health/ready says.
        let timeout = crate::config::CoordinatorConfig::default().ready_warm_timeout();
        let until = now + timeout + Duration::from_secs(5);
        while now < until {
            now += Duration::from_millis(10);
            p.handle_timeout(now);
            assert!(
                !drain(&mut p)
                    .events
                    .iter()
                    .any(|e| matches!(e, ControlEvent::Ready(true))),
                "ready at {now:?} with core 0's journal failed"
            );
        }
    }

    #[test]
    fn ready_does_not_wait_for_warm_routing_beyond_its_timeout() {
        let (mut p, mut now) = until_recover(1);
        recover_empty(&mut p, now);
        drain(&mut p);
        p.handle_registered(now, 0, true, false);
        let start = now;
        run_until(&mut p, &mut now, Duration::from_secs(30), |_, o| {
            o.events
                .iter()
                .any(|e| matches!(e, ControlEvent::Ready(true)))
        });
        // The wait started when the node was Up (before `start`).
        let timeout = crate::config::CoordinatorConfig::default().ready_warm_timeout();
        let waited = now - start;
        assert!(
            now >= timeout && waited < timeout + Duration::from_secs(1),
            "ready after {waited:?}, at {now:?}"
        );
    }

    #[test]
    fn ready_does_not_wait_for_registration_beyond_its_timeout() {
        // The regions never hear from their coordinator (it is slow,
        // unreachable, or on a member that does not run the type).
        let (mut p, mut now) = until_recover(2);
        drain(&mut p);
        let start = now;
        p.handle_registered(now, 1, true, true);
        let o = run_until(&mut p, &mut now, Duration::from_secs(30), |_, o| {
            o.events
                .iter()
                .any(|e| matches!(e, ControlEvent::Ready(true)))
        });
        let timeout = crate::config::CoordinatorConfig::default().ready_warm_timeout();
        let waited = now - start;
        assert!(
            now >= timeout && waited < timeout + Duration::from_secs(1),
            "ready after {waited:?}, at {now:?}"
        );
        assert!(!o
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::Ready(false))));
        // Nothing is due any more at that instant.
        assert!(p.poll_timeout().is_none_or(|t| t > now));
        // The late registration keeps the node ready; a later
        // re-registration (the coordinator moved) makes it unready as
        // usual.
        p.handle_registered(now, 0, true, false);
        assert!(drain(&mut p).events.is_empty());
        p.handle_registered(now, 0, false, false);
        assert!(drain(&mut p)
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::Ready(false))));
    }

    #[test]
    fn a_node_without_entity_types_is_ready_once_up() {
        let mut p = single(2);
        let mut now = Duration::ZERO;
        run_until(&mut p, &mut now, Duration::from_secs(5), |_, o| {
            o.events
                .iter()
                .any(|e| matches!(e, ControlEvent::Ready(true)))
        });
        assert!(p.is_up());
        let timeout = crate::config::CoordinatorConfig::default().ready_warm_timeout();
        assert!(now < timeout, "ready at {now:?}: it waited for nothing");
        // A type started later waits for its regions again.
        p.handle_register_type(now, TYPE, false);
        assert!(drain(&mut p)
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::Ready(false))));
    }

    #[test]
    fn the_oldest_starts_the_coordinator_of_a_type_only_other_members_run() {
        // The oldest member never started `only2`; a region of it asks.
        let mut p = single(1);
        let mut now = Duration::ZERO;
        run_until(&mut p, &mut now, Duration::from_secs(5), |p, _| p.is_up());
        drain(&mut p);
        let ask = |p: &mut ControlPlane, now: Duration| {
            p.handle_to_coordinator(
                now,
                "only2",
                CoordinatorMsg::Register {
                    region: region(0),
                    hosted: Vec::new(),
                    stopping: Vec::new(),
                },
            );
            drain(p)
        };
        let o = ask(&mut p, now);
        assert!(
            o.journal
                .iter()
                .any(|j| matches!(j, JournalOp::Recover { type_name } if type_name == "only2")),
            "no coordinator started"
        );
        // Asking again while it recovers starts nothing more.
        let o = ask(&mut p, now);
        assert!(!o
            .journal
            .iter()
            .any(|j| matches!(j, JournalOp::Recover { .. })));
        p.handle_recovered(
            now,
            1_000,
            "only2",
            Recovery::Read(RecoveredCoordinator::default()),
        );
        let o = drain(&mut p);
        let begin = o.begin().expect("a new incarnation").2;
        let last = o
            .appends()
            .iter()
            .map(|(_, s)| *s)
            .fold(begin, JournalSeq::max);
        p.handle_journal_durable(now, last);
        let o = drain(&mut p);
        assert!(
            o.region_msgs()
                .iter()
                .any(|(c, m)| *c == 0 && *m == RegionMsg::RegisterAck),
            "{:?}",
            o.region_msgs()
        );
        // Starting the type here later keeps that coordinator.
        p.handle_register_type(now, "only2", false);
        assert!(!drain(&mut p)
            .journal
            .iter()
            .any(|j| matches!(j, JournalOp::Recover { .. })));
    }

    #[test]
    fn a_warm_deadline_that_passes_while_a_core_re_registers_arms_no_timer() {
        let (mut p, mut now) = until_recover(1);
        recover_empty(&mut p, now);
        drain(&mut p);
        // Registered but not warm: the warm wait is armed.
        p.handle_registered(now, 0, true, false);
        drain(&mut p);
        let timeout = crate::config::CoordinatorConfig::default().ready_warm_timeout();
        let deadline = now + timeout;
        // The coordinator moves: the core's regions register again, and
        // the wait's deadline passes meanwhile.
        now += Duration::from_millis(100);
        p.handle_registered(now, 0, false, false);
        drain(&mut p);
        now = deadline + Duration::from_millis(1);
        p.handle_timeout(now);
        let o = drain(&mut p);
        // The wait bounds the registration too: ready anyway.
        assert!(o
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::Ready(true))));
        // Nothing is due any more: a timer still due after its handling
        // would be fired again at the same instant without end.
        assert!(
            p.poll_timeout().is_none_or(|t| t > now),
            "still due: {:?} at {now:?}",
            p.poll_timeout()
        );
        // The regions registered again: still ready.
        p.handle_registered(now, 0, true, false);
        let o = drain(&mut p);
        assert!(!o
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::Ready(false))));
    }

    #[test]
    fn a_refused_append_stops_the_coordinator_and_drops_what_it_held() {
        let (mut p, now) = until_recover(1);
        recover_empty(&mut p, now);
        drain(&mut p);
        let o = register(&mut p, now, 0);
        let seq = o.appends()[0].1;
        p.handle_journal_refused(now, TYPE, "fenced by epoch 9".to_string());
        let o = drain(&mut p);
        assert!(o
            .journal
            .iter()
            .any(|j| matches!(j, JournalOp::End { type_name } if type_name == TYPE)));
        assert!(p.coordinator(TYPE).is_none());
        assert_eq!(status(&p).refused.as_deref(), Some("fenced by epoch 9"));
        p.handle_journal_durable(now, seq);
        assert!(drain(&mut p).region_msgs().is_empty());
    }

    #[test]
    fn recovery_prefers_the_journal_then_the_replicated_copy_then_empty() {
        let replicated = state_with(&[(1, 40)]);
        let journaled = state_with(&[(1, 50), (2, 51)]);
        let replicate = |p: &mut ControlPlane, now| {
            p.handle_frame(
                now,
                ControlFrame::CoordinatorEvents {
                    type_name: TYPE.to_string(),
                    reset: true,
                    events: snapshot_events(&replicated)
                        .iter()
                        .map(Into::into)
                        .collect(),
                },
            )
            .expect("a valid frame");
        };

        // A journal holds the type: its state wins over the replicated copy.
        let (mut p, now) = until_recover(1);
        replicate(&mut p, now);
        let rec = RecoveredCoordinator {
            state: journaled.clone(),
            source: Some(std::path::PathBuf::from("/data/n1/control")),
            records: 3,
            ..RecoveredCoordinator::default()
        };
        p.handle_recovered(now, 1_000, TYPE, Recovery::Read(rec));
        let (_, state, _) = drain(&mut p).begin().expect("begins");
        assert_eq!(state, journaled);
        let st = status(&p);
        assert_eq!(
            (st.recovered_from.as_str(), st.recovered_shards),
            ("journal", 2)
        );
        assert_eq!(st.journal_dir.as_deref(), Some("/data/n1/control"));
        assert_eq!(p.coordinator(TYPE).map(|c| c.state().shards.len()), Some(2));

        // No journal holds it: the replicated copy, begun in the journal.
        let (mut p, now) = until_recover(1);
        replicate(&mut p, now);
        recover_empty(&mut p, now);
        let (_, state, _) = drain(&mut p).begin().expect("begins");
        assert_eq!(state, replicated);
        assert_eq!(status(&p).recovered_from, "replicated");

        // Nothing anywhere: empty.
        let (mut p, now) = until_recover(1);
        recover_empty(&mut p, now);
        assert_eq!(
            drain(&mut p).begin().map(|b| b.1),
            Some(CoordinatorState::default())
        );
        assert_eq!(status(&p).recovered_from, "empty");

        // No journal on this node: the replicated copy, nothing begun, and
        // nothing waits for durability.
        let (mut p, now) = until_recover(1);
        replicate(&mut p, now);
        p.handle_recovered(now, 1_000, TYPE, Recovery::NoJournal);
        assert!(drain(&mut p).begin().is_none());
        let st = status(&p);
        assert_eq!(
            (st.recovered_from.as_str(), st.writer_epoch),
            ("replicated", 0)
        );
        let o = register(&mut p, now, 0);
        assert!(o.appends().is_empty());
        assert!(o.region_msgs().contains(&(0, RegionMsg::RegisterAck)));

        // The journal refused: no coordinator, and the reason is shown.
        let (mut p, now) = until_recover(1);
        p.handle_recovered(
            now,
            1_000,
            TYPE,
            Recovery::Failed("config mismatch".to_string()),
        );
        assert!(drain(&mut p).begin().is_none());
        assert!(p.coordinator(TYPE).is_none());
        assert_eq!(status(&p).refused.as_deref(), Some("config mismatch"));
    }

    #[test]
    fn messages_for_a_recovering_coordinator_wait_for_it() {
        let (mut p, now) = until_recover(1);
        let o = register(&mut p, now, 0);
        assert!(o.appends().is_empty() && o.region_msgs().is_empty());
        p.handle_recovered(now, 1_000, TYPE, Recovery::NoJournal);
        assert!(drain(&mut p)
            .region_msgs()
            .contains(&(0, RegionMsg::RegisterAck)));
    }

    #[test]
    fn the_writer_epoch_comes_from_the_given_wall_clock_and_the_recorded_epochs() {
        let wall: u64 = 1_700_000_000_000;
        let begin_with = |rec: RecoveredCoordinator| {
            let (mut p, now) = until_recover(1);
            p.handle_recovered(now, wall, TYPE, Recovery::Read(rec));
            let o = drain(&mut p);
            let epoch = o.begin().expect("begins").0;
            (p, now, epoch)
        };
        // Recorded epochs below the wall clock: the wall clock.
        let (mut p, now, epoch) = begin_with(RecoveredCoordinator {
            highest_epoch: WriterEpoch(5),
            ..RecoveredCoordinator::default()
        });
        assert_eq!(epoch, WriterEpoch(wall));
        assert_eq!(status(&p).writer_epoch, wall);
        // Generations are floored at the same wall clock.
        register(&mut p, now, 0);
        p.handle_to_coordinator(
            now,
            TYPE,
            CoordinatorMsg::GetShardHome {
                region: region(0),
                shard: ShardId(3),
            },
        );
        let generation = drain(&mut p)
            .appends()
            .into_iter()
            .find_map(|(e, _)| match e {
                CoordinatorEvent::ShardHomeAllocated { generation, .. } => Some(generation),
                _ => None,
            })
            .expect("allocated");
        assert!(generation >= Generation(wall), "{generation:?}");
        // A recorded epoch above the wall clock (a clock set back): above it.
        let (_, _, epoch) = begin_with(RecoveredCoordinator {
            highest_epoch: WriterEpoch(wall + 500),
            ..RecoveredCoordinator::default()
        });
        assert_eq!(epoch, WriterEpoch(wall + 501));
        // The database claimed one: that one.
        let (_, _, epoch) = begin_with(RecoveredCoordinator {
            highest_epoch: WriterEpoch(wall + 500),
            claimed_epoch: Some(WriterEpoch(wall + 900)),
            ..RecoveredCoordinator::default()
        });
        assert_eq!(epoch, WriterEpoch(wall + 900));
    }

    fn self_status(p: &ControlPlane) -> String {
        p.view()
            .members
            .iter()
            .find(|m| m.uid == me().uid.0)
            .map(|m| m.status.clone())
            .unwrap_or_default()
    }

    #[test]
    fn a_member_that_never_joined_stops_at_once_when_asked_to_leave() {
        let mut p = never_joined(2);
        let mut now = Duration::ZERO;
        while now < Duration::from_secs(2) {
            now += Duration::from_millis(10);
            p.handle_timeout(now);
            drain(&mut p);
        }
        assert!(!p.is_up());
        p.handle_leave(now, Duration::from_secs(30));
        drain(&mut p);
        p.handle_shutdown_complete(now, 0);
        p.handle_shutdown_complete(now, 1);
        let o = drain(&mut p);
        assert!(
            o.events
                .iter()
                .any(|e| matches!(e, ControlEvent::Stopped { code: 1, .. })),
            "not stopped as left"
        );
        assert!(o
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::LeaveDone)));
    }

    #[test]
    fn a_leave_whose_hand_offs_time_out_leaves_after_half_its_timeout() {
        let (mut p, mut now) = until_recover(2);
        p.handle_recovered(now, 1_000, TYPE, Recovery::NoJournal);
        drain(&mut p);
        let start = now;
        p.handle_leave(now, Duration::from_secs(10));
        let o = drain(&mut p);
        assert!(o
            .cores
            .iter()
            .any(|c| matches!(c, ToCores::All(CoreCommand::GracefulShutdown))));
        // One of the two cores hands off; the other never does.
        p.handle_shutdown_complete(now, 0);
        drain(&mut p);
        let o = run_until(&mut p, &mut now, Duration::from_secs(6), |p, _| {
            self_status(p) != "Up"
        });
        assert!(!o
            .events
            .iter()
            .any(|e| matches!(e, ControlEvent::LeaveDone)));
        assert!(
            now >= start + Duration::from_secs(5),
            "left at {:?}, before half the timeout",
            now - start
        );
        // It leaves the cluster: stopped (left) within the timeout.
        let mut stopped = false;
        run_until(&mut p, &mut now, Duration::from_secs(5), |_, o| {
            stopped |= o
                .events
                .iter()
                .any(|e| matches!(e, ControlEvent::Stopped { code: 1, .. }));
            o.events
                .iter()
                .any(|e| matches!(e, ControlEvent::LeaveDone))
        });
        assert!(stopped, "the member did not leave");
        assert!(now < start + Duration::from_secs(10));
        assert!(p.is_stopped());
    }

    #[test]
    fn a_leave_whose_cores_all_hand_off_leaves_at_once() {
        let (mut p, now) = until_recover(2);
        p.handle_leave(now, Duration::from_secs(10));
        drain(&mut p);
        p.handle_shutdown_complete(now, 0);
        assert_eq!(self_status(&p), "Up");
        p.handle_shutdown_complete(now, 1);
        assert_ne!(self_status(&p), "Up");
    }

    #[test]
    fn a_member_that_never_joined_stops_after_its_hand_off_time_when_its_cores_do_not_answer() {
        // A member that is in no cluster (its seed never answers) has no
        // cluster to leave: it stops once the hand-off phase (half the
        // timeout) is over, before the leave's deadline.
        let mut p = never_joined(1);
        let mut now = Duration::ZERO;
        p.handle_leave(now, Duration::from_secs(2));
        let mut stopped = false;
        run_until(&mut p, &mut now, Duration::from_secs(3), |_, o| {
            stopped |= o
                .events
                .iter()
                .any(|e| matches!(e, ControlEvent::Stopped { code: 1, .. }));
            o.events
                .iter()
                .any(|e| matches!(e, ControlEvent::LeaveDone))
        });
        assert!(stopped, "not stopped as left");
        assert!(now >= Duration::from_secs(1), "{now:?}");
        assert!(now < Duration::from_secs(2), "{now:?}");
    }

    #[test]
    fn replicated_state_events_fold_back_to_the_state_through_the_wire() {
        let region = RegionId {
            member: UniqueAddress {
                address: Address("127.0.0.1:26001".to_string().into()),
                uid: MemberUid(7),
            },
            core: 1,
        };
        let mut st = CoordinatorState::default();
        for e in [
            CoordinatorEvent::ShardRegionRegistered {
                region: region.clone(),
            },
            CoordinatorEvent::ShardHomeAllocated {
                shard: ShardId(1),
                region: region.clone(),
                generation: Generation(40),
            },
            CoordinatorEvent::ShardHomeAllocated {
                shard: ShardId(2),
                region,
                generation: Generation(41),
            },
            CoordinatorEvent::ShardHomeDeallocated {
                shard: ShardId(2),
                generation: Generation(41),
            },
            CoordinatorEvent::ShardUnallocated { shard: ShardId(2) },
        ] {
            st.apply(&e);
        }
        assert!(st.unallocated.contains(&ShardId(2)));
        let wire: Vec<WireCoordinatorEvent> = snapshot_events(&st).iter().map(Into::into).collect();
        let back: Vec<CoordinatorEvent> = wire.into_iter().map(CoordinatorEvent::from).collect();
        assert_eq!(CoordinatorState::from_events(back.iter()), st);
    }
}
