//! The simulated world: nodes, network, entities, the ledger of messages, and
//! the invariant checks.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use shardline::plane::data::{DataPlane, ReplyTo, Status, UserEnvelope};
use shardline_core::det::{DetHashMap as HashMap, DetHashSet as HashSet};
use shardline_core::ids::{Address, EntityId, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{shard_id_of, CoordinatorEvent, CoordinatorMsg, Generation};

use super::scenario::{Action, Params, Scenario};

mod clustered;
mod data;

/// The size of the simulated world.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// Nodes at the start (count). Default 3.
    pub nodes: usize,
    /// Data cores (regions) per node (count). Default 2.
    pub cores: usize,
    /// number_of_shards. Default 24.
    pub shards: u32,
    /// Distinct entity ids in the workload (count). Default 80.
    pub entities: usize,
    /// Most steps in one run (count); exceeding it is a violation (livelock).
    /// Default 1,000,000.
    pub max_steps: u64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            nodes: 3,
            cores: 2,
            shards: 24,
            entities: 80,
            max_steps: 1_000_000,
        }
    }
}

/// A broken invariant.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The invariant's name.
    pub invariant: &'static str,
    /// What was seen.
    pub detail: String,
    /// Virtual time of the step.
    pub at: Duration,
}

/// Counters of one run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Messages accepted from senders (count).
    pub sent: u64,
    /// Messages processed by entities (count).
    pub delivered: u64,
    /// Messages answered with BufferFull (count).
    pub buffer_full: u64,
    /// Messages whose sender lost its node (crashed or stopped) before
    /// the answer: in doubt (count).
    pub lost_with_node: u64,
    /// Shard allocations (count).
    pub allocations: u64,
    /// Entity incarnations started (count).
    pub incarnations: u64,
    /// Shard deallocations: hand-offs and terminated regions (count).
    pub deallocations: u64,
    /// Entity stops requested by regions (count).
    pub stops: u64,
    /// Coordinator starts, the first included (count).
    pub coordinator_starts: u64,
    /// Steps run (count).
    pub steps: u64,
    /// Nodes stopped by their membership (downed) (count).
    pub downed: u64,
    /// Journal events lost because they were not durable
    /// when their writer crashed (count).
    pub journal_lost: u64,
    /// Coordinator incarnations begun from the copy
    /// replicated to their member, the journal holding nothing (count).
    pub replicated_starts: u64,
    /// Graceful leaves given up at their deadline (the
    /// process stopped while still a member) (count).
    pub leaves_given_up: u64,
    /// Messages answered `TimedOut` by their node's data plane (the
    /// sender does not know whether they were processed) (count).
    pub timed_out: u64,
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The first violation, if any.
    pub violation: Option<Violation>,
    /// Counters.
    pub stats: RunStats,
    /// The last events (when tracing was on).
    pub last_events: Vec<String>,
    /// An FNV-1a digest of the whole event trace and its length in lines
    /// (when tracing was on; `(FNV offset, 0)` otherwise): every logged
    /// event, every membership frame that arrived (not logged: the digest
    /// takes its bytes) and every message an entity processed, with their
    /// virtual times. Two runs with the same digest produced the same
    /// events in the same order.
    pub trace_digest: (u64, u64),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    Region(usize),
    Link(usize, usize),
    Mailbox(usize),
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Pending,
    Delivered,
    Failed(&'static str),
    /// The sender was told it may or may not have been processed
    /// (`TimedOut`, or its node went away): it may still be, once.
    InDoubt(&'static str),
}

#[derive(Debug)]
struct Rec {
    sender: u32,
    entity: u32,
    seq: u64,
    loc: Loc,
    outcome: Outcome,
    /// The node the sender sent it to (its answer comes from there).
    origin: usize,
    /// The sender got its answer.
    answered: bool,
}

#[derive(Debug)]
enum Item {
    /// A message (its ledger id) and who its entity answers.
    Msg(u64, ReplyTo),
    Stop(ShardId),
}

#[derive(Debug)]
struct Actor {
    incarnation: u64,
    mailbox: VecDeque<Item>,
    scheduled: bool,
    stop_queued: bool,
}

struct Node {
    addr: Address,
    uid: MemberUid,
    alive: bool,
    leaving: Option<Duration>,
    /// Left gracefully: what it sent before still arrives.
    left: bool,
    /// Stopped cleanly (left or downed): what it sent before it stopped
    /// still arrives.
    flushed: bool,
    sender_base: u32,
    /// The node's data planes, one per data core (the last one a proxy
    /// when the scenario runs one on this node).
    data: Vec<DataPlane>,
    /// A data plane's outputs are being carried out.
    driving_core: Vec<bool>,
    actors: Vec<HashMap<EntityId, Actor>>,
    /// The node's control plane (membership, coordinator hosting, the
    /// durability barrier, the leave).
    plane: Option<Box<shardline::plane::ControlPlane>>,
    /// The plane's outputs are being carried out.
    driving: bool,
    /// Journal writes not yet durable, as (operation, the
    /// journal's length after it).
    seq_len: Vec<(shardline::plane::JournalSeq, usize)>,
    /// When this node's last journal write becomes durable.
    last_flush: Duration,
    /// While leaving: which cores handed off every shard.
    handed_off: Vec<bool>,
    /// Frozen (no input at all) since this time.
    paused: Option<Duration>,
    /// Inputs held while the node is frozen (paused or fenced), in order.
    deferred: Vec<Ev>,
    /// Resumed after a pause longer than 2 x stable_after: it must stop
    /// before it handles a single message.
    long_resumed: bool,
}

impl Node {
    fn member(&self) -> UniqueAddress {
        UniqueAddress {
            address: self.addr.clone(),
            uid: self.uid,
        }
    }
}

#[derive(Debug)]
enum Body {
    /// A frame on an inbound data lane of `core` (a `Forward`; `msg`: its
    /// ledger id, for the ledger's location only).
    Data {
        core: usize,
        conn: u64,
        msg: Option<u64>,
        bytes: Vec<u8>,
    },
    /// A `Reply` frame on an outbound data lane of `core`.
    LaneReply { core: usize, bytes: Vec<u8> },
    /// A message for another core of the node (its ring).
    ToCore {
        core: usize,
        type_name: String,
        envelope: UserEnvelope,
    },
    /// The answer of another core of the node to a message `core`
    /// forwarded to it.
    CoreReply {
        core: usize,
        token: u64,
        status: Status,
        payload: Vec<u8>,
    },
    /// A control frame of a node's plane.
    Frame(Box<shardline::plane::ControlFrame>),
}

#[derive(Debug)]
struct Packet {
    from: usize,
    from_uid: MemberUid,
    to: usize,
    to_uid: MemberUid,
    body: Body,
}

#[derive(Debug)]
enum Ev {
    Arrive(Packet),
    Process {
        slot: usize,
        uid: MemberUid,
        core: usize,
        entity: EntityId,
        incarnation: u64,
    },
    Script(usize),
    WorkloadTick,
    Burst {
        slot: usize,
        uid: MemberUid,
        core: usize,
        sender: u32,
        entity: u32,
        left: u32,
    },
    /// A region's message reaches the coordinator (wherever it runs now)
    /// once more.
    DupToCoordinator(CoordinatorMsg),
    /// The journal made a node's writes up to `seq` durable.
    JournalDurable {
        slot: usize,
        uid: MemberUid,
        seq: shardline::plane::JournalSeq,
    },
    /// A node's coordinator recovery read ends.
    Recovered {
        slot: usize,
        uid: MemberUid,
    },
    /// A graceful leave must be over by now.
    LeaveDeadline(usize, MemberUid),
    /// A data lane of a core closed (`connected`: it had connected).
    LaneClosed {
        slot: usize,
        uid: MemberUid,
        core: usize,
        to: RegionId,
        generation: u64,
        connected: bool,
    },
}

struct Scheduled {
    at: Duration,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> Ordering {
        // Min-heap on (at, seq).
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

/// The world of one run.
pub struct World {
    p: Params,
    cfg: SimConfig,
    scenario: &'static str,
    now: Duration,
    rng: ChaCha8Rng,
    queue: BinaryHeap<Scheduled>,
    seq: u64,
    script: Vec<(Duration, Action)>,
    nodes: Vec<Node>,
    slot_of: HashMap<Address, usize>,
    /// The coordinator journal the planes write.
    journal_of_record: clustered::SimJournal,
    /// Allocations the journal made durable.
    durable_allocs: HashSet<(ShardId, RegionId, Generation)>,
    latest_alloc: Vec<Option<(RegionId, Generation)>>,
    hosts_scratch: Vec<Option<(usize, usize)>>,
    remembered: HashMap<ShardId, std::collections::BTreeSet<EntityId>>,
    isolated: HashSet<usize>,
    held: BTreeMap<(usize, usize), VecDeque<Packet>>,
    /// The data lanes open (or connecting), by (node, core, remote region).
    lanes: HashMap<(usize, usize, RegionId), data::Lane>,
    /// The connection ids of the lanes: the lane's (node, uid, core).
    inbound: HashMap<u64, (usize, MemberUid, usize)>,
    next_lane: u64,
    link_last: HashMap<(usize, usize), Duration>,
    ledger: Vec<Rec>,
    entity_ids: Vec<EntityId>,
    next_seq: HashMap<(u32, u32), u64>,
    last_seq: HashMap<(u32, u32), u64>,
    live: HashMap<EntityId, (usize, usize, u64)>,
    next_incarnation: u64,
    next_sender_base: u32,
    last_crashed: Option<usize>,
    workload_on: bool,
    violation: Option<Violation>,
    stats: RunStats,
    trace: Option<VecDeque<String>>,
    /// FNV-1a digest of every trace line (when tracing), and their count.
    trace_digest: (u64, u64),
    /// A perturbation (tests of the replay check): at the first step at or
    /// after this one whose next two queued events are entities'
    /// processing steps, they run in the opposite order.
    swap_at: Option<u64>,
    /// A cut (tests of the drained check): the run stops at the first
    /// step at or after this time when the last message sent has no
    /// outcome yet, and the end-of-run checks run then.
    cut_at: Option<Duration>,
}

const TRACE_LINES: usize = 60;

impl World {
    /// Builds the world of `scenario` for `seed`.
    pub fn new(scenario: &Scenario, seed: u64, cfg: &SimConfig, trace: bool) -> Self {
        // One RNG for everything, seeded from the seed and the scenario name.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in scenario.name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ h.rotate_left(17));
        let (mut p, mut script) = (scenario.build)(&mut rng, cfg);
        // The node sets the coordinator's flag from the entity type's.
        p.coordinator.remember_entities = p.region.remember_entities;
        script.sort_by_key(|(t, _)| *t);
        let entity_ids: Vec<EntityId> = (0..cfg.entities)
            .map(|i| EntityId::new(format!("e{i}")).expect("valid id"))
            .collect();
        let mut w = Self {
            p,
            cfg: cfg.clone(),
            scenario: scenario.name,
            now: Duration::ZERO,
            rng,
            queue: BinaryHeap::new(),
            seq: 0,
            script,
            nodes: Vec::new(),
            slot_of: HashMap::default(),
            journal_of_record: Default::default(),
            durable_allocs: HashSet::default(),
            latest_alloc: vec![None; cfg.shards as usize],
            hosts_scratch: vec![None; cfg.shards as usize],
            remembered: HashMap::default(),
            isolated: HashSet::default(),
            held: BTreeMap::new(),
            lanes: HashMap::default(),
            inbound: HashMap::default(),
            next_lane: 0,
            link_last: HashMap::default(),
            ledger: Vec::new(),
            entity_ids,
            next_seq: HashMap::default(),
            last_seq: HashMap::default(),
            live: HashMap::default(),
            next_incarnation: 1,
            next_sender_base: 0,
            last_crashed: None,
            workload_on: true,
            violation: None,
            stats: RunStats::default(),
            trace: trace.then(VecDeque::new),
            trace_digest: (0xcbf2_9ce4_8422_2325, 0),
            swap_at: None,
            cut_at: None,
        };
        for i in 0..w.script.len() {
            let at = w.script[i].0;
            w.schedule(at, Ev::Script(i));
        }
        for slot in 0..w.p.nodes.unwrap_or(cfg.nodes) {
            w.start_node(slot);
        }
        w.schedule(Duration::ZERO, Ev::WorkloadTick);
        w
    }

    fn log(&mut self, f: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            if t.len() == TRACE_LINES {
                t.pop_front();
            }
            let line = format!("{:>9.3}s {}", self.now.as_secs_f64(), f());
            fnv_line(&mut self.trace_digest, line.as_bytes());
            t.push_back(line);
        }
    }

    /// Adds an event to the trace's digest only (when tracing): `what`
    /// and `bytes` at the current virtual time.
    fn digest(&mut self, what: impl FnOnce() -> String, bytes: &[u8]) {
        if self.trace.is_some() {
            let head = format!("{:>9.3}s {}", self.now.as_secs_f64(), what());
            fnv_line(&mut self.trace_digest, &[head.as_bytes(), bytes].concat());
        }
    }

    /// Perturbs the run (tests of the replay check): see `swap_at`.
    #[cfg(test)]
    pub(crate) fn swap_processing_at(&mut self, step: u64) {
        self.swap_at = Some(step);
    }

    /// Cuts the run (tests of the drained check): see `cut_at`.
    #[cfg(test)]
    pub(crate) fn cut_with_a_message_pending_after(&mut self, at: Duration) {
        self.cut_at = Some(at);
    }

    /// Whether the perturbation of [`Self::swap_processing_at`] happened.
    #[cfg(test)]
    pub(crate) fn perturbed(&self) -> bool {
        self.swap_at.is_none()
    }

    fn violate(&mut self, invariant: &'static str, detail: String) {
        if self.violation.is_none() {
            self.log(|| format!("VIOLATION {invariant}: {detail}"));
            self.violation = Some(Violation {
                invariant,
                detail,
                at: self.now,
            });
        }
    }

    fn schedule(&mut self, at: Duration, ev: Ev) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at,
            seq: self.seq,
            ev,
        });
    }

    fn region_id(&self, slot: usize, core: usize) -> RegionId {
        RegionId {
            member: self.nodes[slot].member(),
            core: core as u16,
        }
    }

    // ---- membership -------------------------------------------------------

    fn start_node(&mut self, slot: usize) {
        let addr = Address(format!("10.0.0.{}:7101", slot + 1).into());
        let uid = MemberUid(self.rng.gen());
        let sender_base = self.next_sender_base;
        self.next_sender_base += self.cfg.cores as u32 + 1;
        let node = Node {
            addr: addr.clone(),
            uid,
            alive: true,
            leaving: None,
            left: false,
            flushed: false,
            sender_base,
            data: Vec::new(),
            driving_core: Vec::new(),
            actors: (0..=self.cfg.cores).map(|_| HashMap::default()).collect(),
            plane: None,
            driving: false,
            seq_len: Vec::new(),
            last_flush: Duration::ZERO,
            handed_off: Vec::new(),
            paused: None,
            deferred: Vec::new(),
            long_resumed: false,
        };
        if slot == self.nodes.len() {
            self.nodes.push(node);
        } else {
            self.nodes[slot] = node;
        }
        self.slot_of.insert(addr, slot);
        let member = self.nodes[slot].member();
        self.log(|| format!("node {slot} up as {member}"));
        for core in 0..self.cfg.cores {
            let d = self.new_data_plane(slot, core, false);
            self.nodes[slot].data.push(d);
        }
        if self.p.proxy && slot == 0 {
            // A proxy after the data cores: routes, hosts nothing.
            let d = self.new_data_plane(slot, self.cfg.cores, true);
            self.nodes[slot].data.push(d);
        }
        let cores = self.nodes[slot].data.len();
        self.nodes[slot].driving_core = vec![false; cores];
        self.start_cluster_node(slot);
        for core in 0..cores {
            self.drive_core(slot, core);
        }
    }

    fn crash(&mut self, slot: usize) {
        if !self.nodes[slot].alive {
            return;
        }
        let member = self.nodes[slot].member();
        self.log(|| format!("node {slot} ({member}) crashes"));
        self.nodes[slot].alive = false;
        self.nodes[slot].plane = None;
        self.last_crashed = Some(slot);
        let uid = self.nodes[slot].uid;
        self.journal_writer_crashed(slot, uid);
        // The members' failure detectors find out.
        self.lose_everything_at(slot, "node crashed");
    }

    /// Everything held by or in flight to or from `slot` is lost; the
    /// senders are told (the runtime's ask times out).
    ///
    /// The senders that sent to this node lose their connection: what
    /// they still wait for is in doubt (it may be processed elsewhere,
    /// once). The others learn it from their data planes, whose lanes
    /// to this node break.
    fn lose_everything_at(&mut self, slot: usize, why: &'static str) {
        // A node that stops (leaves, or is downed) flushes what it sent
        // before it exits (also when its hand-offs timed out).
        let graceful = self.nodes[slot].flushed;
        for r in &mut self.ledger {
            if r.outcome == Outcome::Pending && r.origin == slot {
                r.outcome = Outcome::InDoubt(why);
                self.stats.lost_with_node += 1;
            }
        }
        self.break_lanes_of(slot);
        for core in 0..self.nodes[slot].actors.len() {
            for (e, a) in self.nodes[slot].actors[core].drain() {
                if self.live.get(&e).is_some_and(|l| l.2 == a.incarnation) {
                    self.live.remove(&e);
                }
            }
        }
        self.held
            .retain(|(a, b), _| (*a != slot || graceful) && *b != slot);
    }

    fn coordinator_slot(&self) -> Option<usize> {
        (0..self.nodes.len()).find(|&s| self.runs_coordinator(s))
    }

    fn run_action(&mut self, a: Action) {
        self.log(|| format!("script: {a:?}"));
        match a {
            Action::Crash(s) => self.crash(s),
            Action::CrashCoordinatorNode => {
                if let Some(s) = self.coordinator_slot() {
                    self.crash(s);
                }
            }
            Action::CrashOther => {
                let c = self.coordinator_slot();
                let cands: Vec<usize> = (0..self.nodes.len())
                    .filter(|s| self.nodes[*s].alive && Some(*s) != c)
                    .collect();
                if !cands.is_empty() {
                    let s = cands[self.rng.gen_range(0..cands.len())];
                    self.crash(s);
                }
            }
            Action::Restart(s) => {
                if s < self.nodes.len() {
                    if self.nodes[s].alive {
                        self.crash(s);
                    }
                    self.start_node(s);
                }
            }
            Action::RestartCrashed => {
                if let Some(s) = self.last_crashed {
                    if !self.nodes[s].alive {
                        self.start_node(s);
                    }
                }
            }
            Action::Join => {
                let s = self.nodes.len();
                self.start_node(s);
            }
            Action::Leave(s) => {
                if s < self.nodes.len() {
                    self.plane_leave(s);
                }
            }
            Action::LeaveCoordinatorNode => {
                if let Some(s) = self.coordinator_slot() {
                    self.plane_leave(s);
                }
            }
            Action::Partition(set) => {
                self.isolated = set.into_iter().collect();
            }
            Action::PartitionCoordinatorNode => {
                self.isolated = self.coordinator_slot().into_iter().collect();
            }
            Action::Heal => {
                self.isolated.clear();
                let held = std::mem::take(&mut self.held);
                for (_, q) in held {
                    for p in q {
                        self.transmit(p);
                    }
                }
            }
            Action::CheckBalanced => self.check_balanced(),
            Action::Pause(s) => self.pause(s),
            Action::Resume(s) => self.resume(s),
        }
    }

    // ---- network ----------------------------------------------------------

    fn send(&mut self, from: usize, to: usize, to_uid: MemberUid, body: Body) {
        let p = Packet {
            from,
            from_uid: self.nodes[from].uid,
            to,
            to_uid,
            body,
        };
        let blocked = self.isolated.contains(&from) != self.isolated.contains(&to);
        if blocked && matches!(&p.body, Body::Frame(f) if clustered::is_membership(f)) {
            // Membership messages are datagrams: a partition loses them.
            return;
        }
        let to_gone = !self.nodes[to].alive || self.nodes[to].uid != to_uid;
        if blocked && !to_gone {
            // (A packet to a stopped node fails at once, as a connection
            // to a dead address does.)
            self.held.entry((from, to)).or_default().push_back(p);
        } else {
            self.transmit(p);
        }
    }

    fn transmit(&mut self, p: Packet) {
        let lat = if p.from == p.to {
            Duration::from_micros(self.rng.gen_range(10..=100))
        } else {
            Duration::from_micros(self.rng.gen_range(500..=20_000))
        };
        let link = (p.from, p.to);
        let last = self.link_last.get(&link).copied().unwrap_or_default();
        let at = (self.now + lat).max(last + Duration::from_nanos(1));
        self.link_last.insert(link, at);
        self.schedule(at, Ev::Arrive(p));
    }

    fn arrive(&mut self, p: Packet) {
        let from_ok = (self.nodes[p.from].alive || self.nodes[p.from].flushed)
            && self.nodes[p.from].uid == p.from_uid;
        let to_ok = self.nodes[p.to].alive && self.nodes[p.to].uid == p.to_uid;
        if !from_ok || !to_ok {
            // The lane broke: its plane learns it (`break_lanes_of`).
            return;
        }
        let slot = p.to;
        match p.body {
            Body::Frame(f) => self.frame_arrive(slot, *f),
            body => self.data_arrive(slot, body),
        }
    }

    // ---- effects ----------------------------------------------------------

    /// Counts a coordinator's allocation event (appended to the journal)
    /// and keeps the latest home of its shard.
    fn note_allocation(&mut self, event: &CoordinatorEvent) {
        match event {
            CoordinatorEvent::ShardHomeAllocated {
                shard,
                region,
                generation,
            } => {
                self.stats.allocations += 1;
                self.latest_alloc[shard.0 as usize] = Some((region.clone(), *generation));
            }
            CoordinatorEvent::ShardHomeDeallocated { shard, .. } => {
                self.stats.deallocations += 1;
                self.latest_alloc[shard.0 as usize] = None;
            }
            _ => {}
        }
    }

    fn create_actor(&mut self, slot: usize, core: usize, entity: &EntityId) {
        // A paused process runs nothing: its incarnation does not count
        // (the world checks that it stops before it acts again).
        let frozen = |s: usize| self.nodes[s].alive && self.frozen(s);
        if let Some((s, c, inc)) = self.live.get(entity).filter(|l| !frozen(l.0)) {
            let detail = format!(
                "entity {entity} started on {slot}/{core} while incarnation {inc} lives on {s}/{c}"
            );
            self.violate("single incarnation", detail);
        }
        let inc = self.next_incarnation;
        self.next_incarnation += 1;
        self.stats.incarnations += 1;
        self.live.insert(entity.clone(), (slot, core, inc));
        self.nodes[slot].actors[core].insert(
            entity.clone(),
            Actor {
                incarnation: inc,
                mailbox: VecDeque::new(),
                scheduled: false,
                stop_queued: false,
            },
        );
    }

    /// A message for an entity of core `core` of `slot` (started first
    /// when it does not run).
    fn deliver(&mut self, slot: usize, core: usize, env: UserEnvelope) {
        let Some(id) = data::msg_id(&env.payload) else {
            return self.violate(
                "harness",
                format!("a message without a ledger id on {slot}/{core}"),
            );
        };
        let entity = env.entity;
        if self.nodes[slot].data[core].region(data::TY).is_proxy() {
            let d = format!("proxy {slot}/{core} delivered message {id} to {entity} locally");
            return self.violate("one home", d);
        }
        match self.nodes[slot].actors[core].get(&entity) {
            None => self.create_actor(slot, core, &entity),
            Some(a) => {
                if a.stop_queued {
                    self.violate(
                        "exactly once",
                        format!("message {id} queued behind the stop message of {entity} on {slot}/{core}: it would be lost"),
                    );
                }
            }
        }
        self.ledger[id as usize].loc = Loc::Mailbox(slot);
        let a = self.nodes[slot].actors[core]
            .get_mut(&entity)
            .expect("created above");
        a.mailbox.push_back(Item::Msg(id, env.sender));
        self.kick(slot, core, &entity);
    }

    fn kick(&mut self, slot: usize, core: usize, entity: &EntityId) {
        let a = self.nodes[slot].actors[core]
            .get_mut(entity)
            .expect("actor exists");
        if a.scheduled || a.mailbox.is_empty() {
            return;
        }
        a.scheduled = true;
        let inc = a.incarnation;
        let d = match a.mailbox.front() {
            Some(Item::Stop(_)) => self.rng.gen_range(self.p.stop_time.0..=self.p.stop_time.1),
            _ => Duration::from_micros(self.rng.gen_range(100..=2000)),
        };
        let uid = self.nodes[slot].uid;
        self.schedule(
            self.now + d,
            Ev::Process {
                slot,
                uid,
                core,
                entity: entity.clone(),
                incarnation: inc,
            },
        );
    }

    fn process(&mut self, slot: usize, uid: MemberUid, core: usize, entity: EntityId, inc: u64) {
        if !self.nodes[slot].alive || self.nodes[slot].uid != uid {
            return;
        }
        let Some(a) = self.nodes[slot].actors[core].get_mut(&entity) else {
            return;
        };
        if a.incarnation != inc {
            return;
        }
        a.scheduled = false;
        let Some(item) = a.mailbox.pop_front() else {
            return;
        };
        self.check_may_act(slot, "processed an entity message");
        match item {
            Item::Msg(id, sender) => {
                self.digest(|| format!("{slot}/{core} {entity} processes {id}"), &[]);
                self.process_msg(&entity, id);
                if !self.nodes[slot].alive {
                    return;
                }
                // The entity answers its sender.
                self.reply(slot, core, sender, Status::Ok, Vec::new());
                if self.p.p_passivate > 0.0 && self.rng.gen_bool(self.p.p_passivate) {
                    let shard = shard_id_of(entity.as_str(), self.cfg.shards);
                    self.passivate(slot, core, shard, &entity);
                }
                if self.nodes[slot].alive && self.nodes[slot].actors[core].contains_key(&entity) {
                    self.kick(slot, core, &entity);
                }
            }
            Item::Stop(shard) => {
                let a = self.nodes[slot].actors[core]
                    .remove(&entity)
                    .expect("present");
                if self.live.get(&entity).is_some_and(|l| l.2 == a.incarnation) {
                    self.live.remove(&entity);
                }
                self.log(|| format!("entity {entity} on {slot}/{core} stopped"));
                if !a.mailbox.is_empty() {
                    self.violate(
                        "exactly once",
                        format!(
                            "{} messages left in the mailbox of {entity} after its stop",
                            a.mailbox.len()
                        ),
                    );
                }
                self.entity_stopped(slot, core, shard, &entity);
            }
        }
    }

    fn process_msg(&mut self, entity: &EntityId, id: u64) {
        let r = &mut self.ledger[id as usize];
        match r.outcome {
            Outcome::Pending => {}
            Outcome::Delivered => {
                let d = format!("message {id} to {entity} processed twice");
                return self.violate("exactly once", d);
            }
            Outcome::Failed(why) => {
                let d =
                    format!("message {id} to {entity} processed after its sender was told: {why}");
                return self.violate("exactly once", d);
            }
            Outcome::InDoubt(_) => {}
        }
        r.outcome = Outcome::Delivered;
        r.loc = Loc::Done;
        let key = (r.sender, r.entity);
        let seq = r.seq;
        if self.entity_ids[r.entity as usize] != *entity {
            let d = format!(
                "message {id} for {} processed by {entity}",
                self.entity_ids[r.entity as usize]
            );
            return self.violate("exactly once", d);
        }
        self.stats.delivered += 1;
        let last = self.last_seq.insert(key, seq);
        if let Some(last) = last {
            if last >= seq {
                let d = format!(
                    "sender {} to {entity}: seq {seq} processed after seq {last}",
                    key.0
                );
                self.violate("order", d);
            }
        }
    }

    // ---- workload ---------------------------------------------------------

    fn workload_tick(&mut self) {
        if !self.workload_on || self.now >= self.p.workload_until {
            return;
        }
        let mean_us = 1e6 / self.p.rate_per_s;
        let u: f64 = self.rng.gen_range(f64::EPSILON..1.0);
        let gap = Duration::from_micros((-u.ln() * mean_us) as u64 + 1);
        self.schedule(self.now + gap, Ev::WorkloadTick);
        let cands: Vec<usize> = (0..self.nodes.len())
            .filter(|s| self.nodes[*s].alive && self.nodes[*s].leaving.is_none())
            .filter(|s| !self.frozen(*s))
            .collect();
        if cands.is_empty() {
            return;
        }
        let slot = cands[self.rng.gen_range(0..cands.len())];
        let core = self.rng.gen_range(0..self.nodes[slot].data.len());
        let n = self.entity_ids.len();
        let e = if self.p.skewed && self.rng.gen_bool(0.8) {
            self.rng.gen_range(0..(n / 10).max(1))
        } else {
            self.rng.gen_range(0..n)
        } as u32;
        let sender = self.nodes[slot].sender_base + core as u32;
        // A burst of 1 to 4 messages from one sender to one entity, a few
        // milliseconds apart.
        let n = self.rng.gen_range(1..=4);
        let uid = self.nodes[slot].uid;
        self.burst(slot, uid, core, sender, e, n);
    }

    fn burst(&mut self, slot: usize, uid: MemberUid, core: usize, sender: u32, e: u32, n: u32) {
        let n_ = &self.nodes[slot];
        if n == 0 || !n_.alive || n_.uid != uid || n_.leaving.is_some() || !self.workload_on {
            return;
        }
        if self.now >= self.p.workload_until {
            return;
        }
        self.send_one(slot, core, sender, e);
        let gap = Duration::from_micros(self.rng.gen_range(500..=15_000));
        self.schedule(
            self.now + gap,
            Ev::Burst {
                slot,
                uid,
                core,
                sender,
                entity: e,
                left: n - 1,
            },
        );
    }

    fn send_one(&mut self, slot: usize, core: usize, sender: u32, e: u32) {
        let seq = {
            let s = self.next_seq.entry((sender, e)).or_insert(0);
            *s += 1;
            *s
        };
        let id = self.ledger.len() as u64;
        self.ledger.push(Rec {
            sender,
            entity: e,
            seq,
            loc: Loc::Region(slot),
            outcome: Outcome::Pending,
            origin: slot,
            answered: false,
        });
        self.stats.sent += 1;
        let entity = self.entity_ids[e as usize].clone();
        self.client_send(slot, core, sender, id, entity);
    }

    // ---- invariants ------------------------------------------------------

    fn check_homes(&mut self) {
        let mut hosts = std::mem::take(&mut self.hosts_scratch);
        hosts.iter_mut().for_each(|h| *h = None);
        let mut bad: Option<(&'static str, String)> = None;
        'outer: for slot in 0..self.nodes.len() {
            let n = &self.nodes[slot];
            // A frozen process (paused, or fenced after a pause) acts on
            // nothing; it must stop before it does.
            if !n.alive || self.frozen(slot) {
                continue;
            }
            for (core, d) in n.data.iter().enumerate() {
                let r = d.region(data::TY);
                for (s, g, stopping) in r.hosted_shards() {
                    if let Some((os, oc)) = hosts[s.0 as usize].replace((slot, core)) {
                        bad = Some((
                            "one home",
                            format!("shard {s} hosted by {os}/{oc} and {slot}/{core}"),
                        ));
                        break 'outer;
                    }
                    if stopping {
                        continue;
                    }
                    match &self.latest_alloc[s.0 as usize] {
                        Some((home, ag)) if home == r.id() && g <= *ag => {}
                        other => {
                            bad = Some((
                                "one home",
                                format!(
                                    "{slot}/{core} runs shard {s} at {g} but the journal says {other:?}"
                                ),
                            ));
                            break 'outer;
                        }
                    }
                }
            }
        }
        self.hosts_scratch = hosts;
        if let Some((inv, d)) = bad {
            self.violate(inv, d);
        }
    }

    fn check_balanced(&mut self) {
        let c = self.coordinator_slot().and_then(|cs| {
            let p = self.nodes[cs].plane.as_ref()?;
            p.coordinator(clustered::TYPE)
        });
        let Some(c) = c else {
            return self.violate("balanced", "no coordinator".into());
        };
        let counts: Vec<usize> = c
            .state()
            .regions
            .iter()
            .filter(|(r, _)| {
                self.slot_of.get(&r.member.address).is_some_and(|s| {
                    let n = &self.nodes[*s];
                    n.alive && n.uid == r.member.uid && n.leaving.is_none()
                })
            })
            .map(|(_, s)| s.len())
            .collect();
        let (min, max) = (
            counts.iter().min().copied().unwrap_or(0),
            counts.iter().max().copied().unwrap_or(0),
        );
        if max > min + 1 {
            self.violate(
                "balanced",
                format!("shard counts per region {counts:?} differ by more than 1"),
            );
        }
    }

    /// With remember entities: at the end, every shard with remembered
    /// entities has a home (it was allocated again without waiting for a
    /// message after it lost one), while a coordinator runs and a node is
    /// alive.
    fn check_remembered_homed(&mut self) {
        if !self.p.region.remember_entities
            || self.coordinator_slot().is_none()
            || !self.nodes.iter().any(|n| n.alive)
        {
            return;
        }
        let homeless: Vec<ShardId> = self
            .remembered
            .iter()
            .filter(|(s, ids)| !ids.is_empty() && self.latest_alloc[s.0 as usize].is_none())
            .map(|(s, _)| *s)
            .collect();
        if !homeless.is_empty() {
            let d = format!("shards with remembered entities but no home at the end: {homeless:?}");
            self.violate("remembered homed", d);
        }
    }

    fn check_drained(&mut self) {
        let pending: Vec<(usize, Loc)> = self
            .ledger
            .iter()
            .enumerate()
            .filter(|(_, r)| r.outcome == Outcome::Pending)
            .map(|(i, r)| (i, r.loc))
            .take(5)
            .collect();
        if !pending.is_empty() {
            let n = self
                .ledger
                .iter()
                .filter(|r| r.outcome == Outcome::Pending)
                .count();
            return self.violate(
                "drained",
                format!("{n} messages neither processed nor failed at the end, e.g. {pending:?}"),
            );
        }
        for slot in 0..self.nodes.len() {
            if !self.nodes[slot].alive {
                continue;
            }
            for (core, d) in self.nodes[slot].data.iter().enumerate() {
                let r = d.region(data::TY);
                if r.buffered() > 0 {
                    let d = format!("region {slot}/{core} still buffers {}", r.buffered());
                    return self.violate("drained", d);
                }
            }
        }
    }

    // ---- the loop --------------------------------------------------------

    fn next_timer(&self) -> Option<Duration> {
        let mut t: Option<Duration> = None;
        for (slot, n) in self.nodes.iter().enumerate().filter(|(_, n)| n.alive) {
            if n.paused.is_none() {
                if let Some(p) = &n.plane {
                    t = min_opt(t, p.poll_timeout());
                }
            }
            if self.frozen(slot) {
                continue;
            }
            for d in &n.data {
                t = min_opt(t, d.poll_timeout());
            }
        }
        t
    }

    fn fire_timers(&mut self) {
        let now = self.now;
        for slot in 0..self.nodes.len() {
            if !self.nodes[slot].alive {
                continue;
            }
            self.plane_timer(slot);
            if !self.nodes[slot].alive || self.frozen(slot) {
                continue;
            }
            for core in 0..self.nodes[slot].data.len() {
                if !self.nodes[slot].alive {
                    break;
                }
                if self.nodes[slot].data[core]
                    .poll_timeout()
                    .is_some_and(|t| t <= now)
                {
                    self.nodes[slot].data[core].handle_timeout(now);
                    self.drive_core(slot, core);
                }
            }
        }
    }

    /// Runs the scenario to its end (or to the first violation).
    pub fn run(&mut self) {
        let end = self.p.run_until;
        self.run_until(end);
    }

    /// Runs to virtual time `end` (or to the first violation), then checks
    /// that everything drained.
    pub fn run_until(&mut self, end: Duration) {
        while self.violation.is_none() {
            self.stats.steps += 1;
            if self.stats.steps > self.cfg.max_steps {
                let d = format!("more than {} steps", self.cfg.max_steps);
                self.violate("bounded", d);
                break;
            }
            let ev_at = self.queue.peek().map(|s| s.at);
            let timer_at = self.next_timer();
            let next = min_opt(ev_at, timer_at);
            let Some(next) = next else { break };
            if next > end {
                break;
            }
            self.now = self.now.max(next);
            if timer_at.is_some_and(|t| t <= next) && ev_at.is_none_or(|e| e >= next) {
                self.fire_timers();
            } else {
                let s = self.queue.pop().expect("peeked");
                if self.swap_at.is_some_and(|n| self.stats.steps >= n)
                    && matches!(s.ev, Ev::Process { .. })
                    && matches!(self.queue.peek().map(|s| &s.ev), Some(Ev::Process { .. }))
                {
                    self.swap_at = None;
                    let second = self.queue.pop().expect("peeked");
                    self.now = self.now.max(second.at);
                    self.step(second.ev);
                }
                self.step(s.ev);
            }
            self.check_homes();
            self.check_one_coordinator();
            if self.cut_at.is_some_and(|t| self.now >= t)
                && self
                    .ledger
                    .last()
                    .is_some_and(|r| r.outcome == Outcome::Pending)
            {
                break;
            }
        }
        if self.violation.is_none() {
            self.now = end;
            self.check_drained();
            if self.violation.is_none() {
                self.check_remembered_homed();
            }
            self.check_clustered_end();
        }
    }

    fn step(&mut self, ev: Ev) {
        let ev = match self.defer_if_frozen(ev) {
            Some(ev) => ev,
            None => return,
        };
        match ev {
            Ev::Arrive(p) => {
                match &p.body {
                    Body::Frame(f) if clustered::is_membership(f) => {
                        if let shardline::plane::ControlFrame::Cluster { bytes } = &**f {
                            let (from, to) = (p.from, p.to);
                            self.digest(|| format!("arrive {from}->{to}: membership "), bytes);
                        }
                    }
                    _ => self.log(|| format!("arrive {}->{}: {:?}", p.from, p.to, p.body)),
                }
                self.arrive(p)
            }
            Ev::Process {
                slot,
                uid,
                core,
                entity,
                incarnation,
            } => self.process(slot, uid, core, entity, incarnation),
            Ev::Script(i) => {
                let a = self.script[i].1.clone();
                self.run_action(a);
            }
            Ev::WorkloadTick => self.workload_tick(),
            Ev::Burst {
                slot,
                uid,
                core,
                sender,
                entity,
                left,
            } => self.burst(slot, uid, core, sender, entity, left),
            Ev::DupToCoordinator(msg) => self.dup_to_coordinator(msg),
            Ev::JournalDurable { slot, uid, seq } => self.journal_durable(slot, uid, seq),
            Ev::Recovered { slot, uid } => self.recovered(slot, uid),
            Ev::LeaveDeadline(slot, uid) => self.leave_deadline(slot, uid),
            Ev::LaneClosed {
                slot,
                uid,
                core,
                to,
                generation,
                connected,
            } => self.lane_closed(slot, uid, core, to, generation, connected),
        }
    }

    /// The outcome so far.
    pub fn outcome(&self) -> RunOutcome {
        RunOutcome {
            violation: self.violation.clone(),
            stats: self.stats.clone(),
            last_events: self
                .trace
                .as_ref()
                .map(|t| t.iter().cloned().collect())
                .unwrap_or_default(),
            trace_digest: self.trace_digest,
        }
    }

    /// The scenario's name.
    pub fn scenario(&self) -> &'static str {
        self.scenario
    }
}

/// Adds one line (`bytes` and a newline) to an FNV-1a digest and counts it.
fn fnv_line((h, n): &mut (u64, u64), bytes: &[u8]) {
    for b in bytes.iter().copied().chain(std::iter::once(b'\n')) {
        *h = (*h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    *n += 1;
}

fn min_opt(a: Option<Duration>, b: Option<Duration>) -> Option<Duration> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}
