//! The deterministic simulation of cluster membership: the real
//! `shardline_core::cluster::ClusterNode` on every node, a seeded lossy
//! network, pauses, crashes and restarts, checked by invariants.
//!
//! ```text
//!   scenario script ──> MembershipWorld ──(virtual clock, one ChaCha8 RNG)──> steps
//!                        │ N nodes: ClusterNode (gossip, phi, SBR, singleton)
//!                        │ network: per-packet latency, loss, spikes, cuts
//!                        │ every message goes through the wire codec
//!                        └─ invariants after every step, and at the end
//! ```
//!
//! Every alive node also gets an application request every 200 ms (virtual)
//! and serves it only while `ClusterNode::is_available`.
//!
//! Invariants (after every step unless stated):
//! - **one coordinator**: at most one node that is neither stopped nor
//!   paused runs the coordinator singleton;
//! - **no zombie**: a node never serves a request while another live node
//!   has removed it (its shards are re-homed after removal);
//! - **downed stops**: a node whose own view says it is Down has stopped;
//! - **paused stops first** (pause scenario): a node paused for longer than
//!   twice `stable_after` serves nothing after it resumes and stops;
//! - **converged** (end): the live nodes agree on the member set, every
//!   member is Up and live, and exactly one of them runs the coordinator;
//! - **no split brain** (end): no two live nodes each see the other Down or
//!   removed — after the decision, one side only remains;
//! - **re-homed within the bound** (crash scenarios): a process that died on
//!   a host that is up (its port refuses connections) is removed by every
//!   live member, and the coordinator runs on a live member, within
//!   [`REHOME_BOUND`] of the crash (its shards are re-allocated on
//!   removal); a crash seen through timeouts only (a whole host, a
//!   partition, a pause) is never removed before `stable_after`;
//! - the scenario's **expected survivors** (end): e.g. keep-majority keeps
//!   the majority of a 3|2 partition; a 2|2 tie keeps the side with the
//!   lowest address; a 2|2|1 split downs everyone; no member is downed on a
//!   flaky network unless its phi crossed the threshold.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use shardline_core::cluster::{
    decode, encode, ClusterConfig, ClusterEvent, ClusterMessage, ClusterNode, DowningConfig,
    MemberStatus, SbrConfig, SbrStrategy, SingletonCommand, StopReason,
};
use shardline_core::ids::{Address, MemberUid, UniqueAddress};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn s(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// `stable_after` of the split-brain resolver in the simulation.
pub const STABLE_AFTER: Duration = Duration::from_secs(5);

/// The bound within which a dead process whose port refuses connections
/// is removed by every live member and the coordinator runs again (the
/// simulation's settings: heartbeat and gossip every 1 s, probes every
/// 200 ms, 3 refusals, latency up to 10 ms).
pub const REHOME_BOUND: Duration = Duration::from_millis(2_500);

/// Network behaviour.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetParams {
    /// Latency range of a packet (min, max).
    pub latency: (Duration, Duration),
    /// Probability that a packet is lost.
    pub loss: f64,
    /// Probability that a packet is delayed by a spike.
    pub spike: f64,
    /// Extra delay of a spike (at most).
    pub spike_max: Duration,
}

impl NetParams {
    /// A clean LAN: 1–10 ms, no loss.
    pub fn clean() -> Self {
        Self {
            latency: (ms(1), ms(10)),
            loss: 0.0,
            spike: 0.0,
            spike_max: Duration::ZERO,
        }
    }
}

/// A scripted step.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Start (or restart with a new uid) the node at this slot.
    Start(usize),
    /// Crash the node at this slot with its host (every packet to it is
    /// lost: only timeouts tell).
    Crash(usize),
    /// Crash the process at this slot, its host staying up: its cluster
    /// port refuses connections (every packet to it is refused back to the
    /// sender), and the members' links to it report a lost connection.
    CrashProcess(usize),
    /// Crash this slot within one heartbeat interval after it becomes a
    /// member.
    CrashSoonAfterJoin(usize),
    /// Graceful leave.
    Leave(usize),
    /// Cut every link between different groups (slots not listed keep all
    /// their links).
    Partition(Vec<Vec<usize>>),
    /// Cut the link between two slots (both directions).
    CutLink(usize, usize),
    /// Heal every cut.
    Heal,
    /// Change the network's behaviour.
    Net(NetParams),
    /// Stop feeding this node any input (a frozen process).
    Pause(usize),
    /// Feed it again (queued messages first).
    Resume(usize),
    /// Check that this slot's node left gracefully (stopped with Left).
    ExpectLeft(usize),
}

/// What the end of the run must look like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Exactly these slots run at the end.
    Survivors(BTreeSet<usize>),
    /// Every node has stopped.
    AllStopped,
    /// Nobody stopped unless a failure detector once crossed its threshold;
    /// then the survivors must merely be consistent.
    NoFalseDowning,
    /// Any outcome that passes the generic end checks: one consistent
    /// decision (survivors converged, the rest stopped) or down-all.
    Consistent,
}

/// One run's parameters and script.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Number of node slots.
    pub nodes: usize,
    /// Slots started at time zero.
    pub initial: Vec<usize>,
    /// Timed actions.
    pub script: Vec<(Duration, Action)>,
    /// The end of the run (the network is healed and clean from
    /// `settle_from` on).
    pub run_until: Duration,
    /// From here on the network is clean and healed.
    pub settle_from: Duration,
    /// The expected end state.
    pub expect: Expect,
    /// The slot that is paused for more than 2 x stable_after, if any.
    pub long_pause: Option<usize>,
    /// Nobody may be downed in this run (a short pause).
    pub no_downing: bool,
    /// The split-brain resolver's strategy.
    pub strategy: SbrStrategy,
}

/// A membership scenario.
pub struct MembershipScenario {
    /// Its name (for `--scenario`).
    pub name: &'static str,
    /// What it exercises.
    pub about: &'static str,
    build: fn(&mut ChaCha8Rng) -> Plan,
}

impl std::fmt::Debug for MembershipScenario {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// A broken invariant.
#[derive(Debug, Clone)]
pub struct MembershipViolation {
    /// The invariant's name.
    pub invariant: &'static str,
    /// What was seen.
    pub detail: String,
    /// Virtual time.
    pub at: Duration,
}

/// The result of one run.
#[derive(Debug, Clone)]
pub struct MembershipOutcome {
    /// The first violation.
    pub violation: Option<MembershipViolation>,
    /// The last events (when tracing).
    pub last_events: Vec<String>,
    /// Steps run (count).
    pub steps: u64,
    /// Packets sent (count).
    pub packets: u64,
    /// Nodes stopped because they were downed (count).
    pub downed: u64,
    /// Coordinator starts (count).
    pub coordinator_starts: u64,
    /// Application requests served (count).
    pub served: u64,
    /// The longest time from a process crash (refusing port) to its removal
    /// everywhere and a live coordinator, in ms (0 without such a crash).
    pub max_rehome_ms: u64,
}

struct Node {
    cn: ClusterNode,
    paused: bool,
    inbox: VecDeque<ClusterMessage>,
    stopped: Option<StopReason>,
    singleton: bool,
    resumed_after_long_pause: bool,
    crash_after_join: bool,
}

#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Packet {
    at: Duration,
    seq: u64,
    to: usize,
    bytes: Vec<u8>,
    /// Not a message: the connection `to` opened to this address was
    /// refused (or, with `lost`, the established one was closed).
    report: Option<(Address, bool)>,
}

/// A crash whose re-homing is being watched.
#[derive(Debug, Clone)]
struct Crashed {
    at: Duration,
    uid: UniqueAddress,
    /// Whether the port refuses (process crash) or not (host crash).
    refusing: bool,
    done: bool,
}

const MAX_STEPS: u64 = 2_000_000;
const INBOX_LIMIT: usize = 10_000;
const APP_INTERVAL: Duration = Duration::from_millis(200);
const TRACE_KEEP: usize = 60;

/// The membership world.
pub struct MembershipWorld {
    rng: ChaCha8Rng,
    now: Duration,
    plan: Plan,
    script: VecDeque<(Duration, Action)>,
    nodes: Vec<Option<Node>>,
    addrs: Vec<Address>,
    slot_of: BTreeMap<Address, usize>,
    packets: BinaryHeap<Reverse<Packet>>,
    seq: u64,
    cut: BTreeSet<(usize, usize)>,
    net: NetParams,
    next_app: Duration,
    timed: Vec<(Duration, Action)>,
    trace: bool,
    log: VecDeque<String>,
    violation: Option<MembershipViolation>,
    ever_unreachable: bool,
    stats: MembershipOutcome,
    /// Slots whose process is dead on a live host (their port refuses).
    refusing: BTreeSet<usize>,
    crashes: Vec<Crashed>,
}

impl MembershipWorld {
    /// A world for `scenario` and `seed`.
    pub fn new(scenario: &MembershipScenario, seed: u64, trace: bool) -> Self {
        let name_hash = scenario
            .name
            .bytes()
            .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ name_hash);
        let plan = (scenario.build)(&mut rng);
        let addrs: Vec<Address> = (0..plan.nodes)
            .map(|i| Address(format!("10.0.0.{}:7101", i + 1).into()))
            .collect();
        let slot_of = addrs
            .iter()
            .cloned()
            .enumerate()
            .map(|(i, a)| (a, i))
            .collect();
        let mut script: Vec<(Duration, Action)> = plan.script.clone();
        script.sort_by_key(|(t, _)| *t);
        let mut w = Self {
            rng,
            now: Duration::ZERO,
            script: script.into(),
            nodes: (0..plan.nodes).map(|_| None).collect(),
            addrs,
            slot_of,
            packets: BinaryHeap::new(),
            seq: 0,
            cut: BTreeSet::new(),
            net: NetParams::clean(),
            next_app: APP_INTERVAL,
            timed: Vec::new(),
            trace,
            log: VecDeque::new(),
            violation: None,
            ever_unreachable: false,
            stats: MembershipOutcome {
                violation: None,
                last_events: Vec::new(),
                steps: 0,
                packets: 0,
                downed: 0,
                coordinator_starts: 0,
                served: 0,
                max_rehome_ms: 0,
            },
            plan,
            refusing: BTreeSet::new(),
            crashes: Vec::new(),
        };
        for i in w.plan.initial.clone() {
            w.start(i);
        }
        w
    }

    fn log(&mut self, f: impl FnOnce() -> String) {
        if self.trace {
            if self.log.len() >= TRACE_KEEP {
                self.log.pop_front();
            }
            let line = format!("{:>9.3}s {}", self.now.as_secs_f64(), f());
            self.log.push_back(line);
        }
    }

    fn violate(&mut self, invariant: &'static str, detail: String) {
        if self.violation.is_none() {
            self.log(|| format!("VIOLATION {invariant}: {detail}"));
            self.violation = Some(MembershipViolation {
                invariant,
                detail,
                at: self.now,
            });
        }
    }

    fn config(&self, slot: usize) -> ClusterConfig {
        let seeds = self.addrs.iter().take(3).cloned().collect();
        let mut cfg = ClusterConfig::new(self.addrs[slot].clone(), seeds);
        let mut sbr = SbrConfig::with_stable_after(STABLE_AFTER);
        sbr.strategy = self.plan.strategy.clone();
        cfg.downing = DowningConfig::SplitBrainResolver(sbr);
        cfg.random_seed = self.rng.clone().gen();
        cfg
    }

    fn start(&mut self, slot: usize) {
        if let Some(old) = self.nodes[slot].as_ref() {
            if old.stopped.is_none() {
                self.log(|| format!("node {slot} replaced while running (crash-restart)"));
            }
        }
        self.refusing.remove(&slot);
        let cfg = self.config(slot);
        let uid = MemberUid(self.rng.gen());
        let mut cn = ClusterNode::new(cfg, uid, self.now);
        cn.subscribe();
        self.log(|| format!("start node {slot} uid {}", uid.0));
        self.nodes[slot] = Some(Node {
            cn,
            paused: false,
            inbox: VecDeque::new(),
            stopped: None,
            singleton: false,
            resumed_after_long_pause: false,
            crash_after_join: false,
        });
        self.drain(slot);
    }

    fn crash(&mut self, slot: usize, refusing: bool) {
        let Some(n) = self.nodes[slot].take() else {
            return;
        };
        self.log(|| format!("crash node {slot} (port refuses: {refusing})"));
        if n.stopped.is_none() && n.cn.self_member().is_some() {
            self.crashes.push(Crashed {
                at: self.now,
                uid: n.cn.self_address().clone(),
                refusing,
                done: false,
            });
        }
        if refusing {
            self.refusing.insert(slot);
            // the members' established links see the close
            for other in 0..self.nodes.len() {
                if other != slot
                    && self.nodes[other].is_some()
                    && !self.cut.contains(&(slot, other))
                {
                    let lat = self.latency();
                    self.seq += 1;
                    self.packets.push(Reverse(Packet {
                        at: self.now + lat,
                        seq: self.seq,
                        to: other,
                        bytes: Vec::new(),
                        report: Some((self.addrs[slot].clone(), true)),
                    }));
                }
            }
        }
    }

    fn latency(&mut self) -> Duration {
        let (lo, hi) = self.net.latency;
        let mut lat = ms(self
            .rng
            .gen_range(lo.as_millis() as u64..=hi.as_millis() as u64));
        if self.net.spike > 0.0 && self.rng.gen_bool(self.net.spike) {
            lat += ms(self
                .rng
                .gen_range(0..=self.net.spike_max.as_millis() as u64));
        }
        lat
    }

    fn live(&self, slot: usize) -> Option<&Node> {
        self.nodes[slot].as_ref().filter(|n| n.stopped.is_none())
    }

    /// Drains the effects of one node and checks the per-node invariants.
    fn drain(&mut self, slot: usize) {
        let now = self.now;
        let mut sends = Vec::new();
        let mut lines = Vec::new();
        {
            let Some(node) = self.nodes[slot].as_mut() else {
                return;
            };
            if let Some(r) = node.cn.poll_stop() {
                node.stopped = Some(r);
                node.singleton = false;
                lines.push(format!("node {slot} stops: {r:?}"));
                if r == StopReason::Downed {
                    self.stats.downed += 1;
                }
            }
            while let Some(c) = node.cn.poll_singleton() {
                match c {
                    SingletonCommand::Start => {
                        node.singleton = node.stopped.is_none();
                        self.stats.coordinator_starts += 1;
                        lines.push(format!("node {slot} starts the coordinator"));
                    }
                    SingletonCommand::Stop => {
                        node.singleton = false;
                        lines.push(format!("node {slot} stops the coordinator"));
                        node.cn.handle_singleton_stopped(now);
                    }
                }
            }
            while let Some(e) = node.cn.poll_event() {
                match &e {
                    ClusterEvent::UnreachableMember(m) => {
                        self.ever_unreachable = true;
                        lines.push(format!("node {slot}: unreachable {}", m.unique_address));
                    }
                    ClusterEvent::ReachableMember(m) => {
                        lines.push(format!("node {slot}: reachable {}", m.unique_address));
                    }
                    ClusterEvent::MemberDowned(m) => {
                        lines.push(format!("node {slot}: downed {}", m.unique_address));
                    }
                    ClusterEvent::MemberRemoved { member, .. } => {
                        lines.push(format!("node {slot}: removed {}", member.unique_address));
                    }
                    ClusterEvent::MemberUp(m) => {
                        lines.push(format!("node {slot}: up {}", m.unique_address));
                    }
                    _ => {}
                }
            }
            while let Some(t) = node.cn.poll_transmit() {
                sends.push(t);
            }
            if node.crash_after_join && node.cn.self_member().is_some() {
                node.crash_after_join = false;
                let delay = ms(self.rng.gen_range(0..1000));
                self.timed.push((now + delay, Action::Crash(slot)));
                lines.push(format!("node {slot} is a member; crash in {delay:?}"));
            }
            let downed_in_own_view = node
                .cn
                .self_member()
                .is_some_and(|m| m.status == MemberStatus::Down);
            if downed_in_own_view && node.stopped.is_none() {
                lines.push(format!("node {slot} is Down in its own view but runs"));
                self.violation.get_or_insert(MembershipViolation {
                    invariant: "downed stops",
                    detail: format!("node {slot} sees itself Down and has not stopped"),
                    at: now,
                });
            }
        }
        for l in lines {
            self.log(|| l);
        }
        for t in sends {
            self.send(slot, t.to, &t.message);
        }
    }

    fn send(&mut self, from: usize, to: Address, msg: &ClusterMessage) {
        let Some(&to) = self.slot_of.get(&to) else {
            return;
        };
        self.stats.packets += 1;
        if self.cut.contains(&(from, to)) || self.rng.gen_bool(self.net.loss) {
            return;
        }
        let lat = self.latency();
        self.seq += 1;
        if self.refusing.contains(&to) && self.nodes[to].is_none() {
            // the host answers the connect with a reset: a round trip
            let back = self.latency();
            self.packets.push(Reverse(Packet {
                at: self.now + lat + back,
                seq: self.seq,
                to: from,
                bytes: Vec::new(),
                report: Some((self.addrs[to].clone(), false)),
            }));
            return;
        }
        self.packets.push(Reverse(Packet {
            at: self.now + lat,
            seq: self.seq,
            to,
            bytes: encode(msg),
            report: None,
        }));
    }

    fn deliver(&mut self, p: Packet) {
        if let Some((addr, lost)) = &p.report {
            let now = self.now;
            let Some(node) = self.nodes[p.to].as_mut() else {
                return;
            };
            if node.stopped.is_some() || node.paused {
                return;
            }
            if *lost {
                node.cn.handle_connection_lost(now, addr);
            } else {
                node.cn.handle_connection_refused(now, addr);
            }
            self.drain(p.to);
            return;
        }
        let msg = match decode(&p.bytes) {
            Ok(m) => m,
            Err(e) => {
                self.violate(
                    "codec",
                    format!("a packet to node {} did not decode: {e}", p.to),
                );
                return;
            }
        };
        let now = self.now;
        let Some(node) = self.nodes[p.to].as_mut() else {
            return;
        };
        if node.stopped.is_some() {
            return;
        }
        if node.paused {
            if node.inbox.len() < INBOX_LIMIT {
                node.inbox.push_back(msg);
            }
            return;
        }
        node.cn.handle_message(now, msg);
        self.drain(p.to);
    }

    fn run_action(&mut self, a: Action) {
        self.log(|| format!("script: {a:?}"));
        match a {
            Action::Start(i) => self.start(i),
            Action::Crash(i) => self.crash(i, false),
            Action::CrashProcess(i) => self.crash(i, true),
            Action::CrashSoonAfterJoin(i) => {
                self.start(i);
                if let Some(n) = self.nodes[i].as_mut() {
                    n.crash_after_join = true;
                }
            }
            Action::Leave(i) => {
                let now = self.now;
                if let Some(n) = self.nodes[i].as_mut() {
                    n.cn.leave(now);
                }
                self.drain(i);
            }
            Action::Partition(groups) => {
                for (gi, g) in groups.iter().enumerate() {
                    for (hi, h) in groups.iter().enumerate() {
                        if gi != hi {
                            for &a in g {
                                for &b in h {
                                    self.cut.insert((a, b));
                                }
                            }
                        }
                    }
                }
            }
            Action::CutLink(a, b) => {
                self.cut.insert((a, b));
                self.cut.insert((b, a));
            }
            Action::Heal => self.cut.clear(),
            Action::Net(p) => self.net = p,
            Action::Pause(i) => {
                if let Some(n) = self.nodes[i].as_mut() {
                    n.paused = true;
                }
            }
            Action::Resume(i) => {
                let now = self.now;
                let long = self.plan.long_pause == Some(i);
                let Some(n) = self.nodes[i].as_mut() else {
                    return;
                };
                n.paused = false;
                n.resumed_after_long_pause = long;
                let inbox = std::mem::take(&mut n.inbox);
                n.cn.handle_timeout(now);
                self.drain(i);
                for m in inbox {
                    if let Some(n) = self.nodes[i].as_mut() {
                        n.cn.handle_message(now, m);
                    }
                    self.drain(i);
                }
            }
            Action::ExpectLeft(i) => {
                let left = self.nodes[i]
                    .as_ref()
                    .is_some_and(|n| n.stopped == Some(StopReason::Left));
                if !left {
                    self.violate(
                        "left",
                        format!("node {i} did not complete its graceful leave"),
                    );
                }
            }
        }
    }

    fn app_tick(&mut self) {
        for slot in 0..self.nodes.len() {
            let Some(n) = self.nodes[slot].as_ref() else {
                continue;
            };
            if n.paused || n.stopped.is_some() || !n.cn.is_available() {
                continue;
            }
            let me = n.cn.self_address().clone();
            if n.resumed_after_long_pause {
                self.violate(
                    "paused stops first",
                    format!(
                        "node {slot} served a request after a pause longer than 2 x stable_after"
                    ),
                );
            }
            self.stats.served += 1;
            for other in 0..self.nodes.len() {
                if other == slot {
                    continue;
                }
                if let Some(o) = self.live(other) {
                    if o.cn.gossip().tombstones.contains(&me) {
                        self.violate(
                            "no zombie",
                            format!("node {slot} ({me}) serves although node {other} removed it"),
                        );
                    }
                }
            }
        }
    }

    /// Re-homed within the bound: see the module's invariants.
    fn check_rehome(&mut self) {
        let now = self.now;
        let live: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.live(i).is_some_and(|n| !n.paused))
            .collect();
        let coordinator_live = live
            .iter()
            .any(|&i| self.live(i).is_some_and(|n| n.singleton));
        let mut broken = None;
        let mut longest = self.stats.max_rehome_ms;
        for c in self.crashes.iter_mut().filter(|c| !c.done) {
            let removed_everywhere = live.iter().all(|&i| {
                self.nodes[i]
                    .as_ref()
                    .is_some_and(|n| !n.cn.gossip().members.contains_key(&c.uid))
            });
            if removed_everywhere && !c.refusing && now < c.at + STABLE_AFTER {
                broken = Some((
                    "timeouts keep the resolver's rules",
                    format!(
                        "{} crashed with its host at {:?} and was removed {:?} later, before stable_after",
                        c.uid,
                        c.at,
                        now - c.at
                    ),
                ));
            }
            if removed_everywhere && (coordinator_live || live.is_empty()) {
                c.done = true;
                if c.refusing {
                    longest = longest.max((now - c.at).as_millis() as u64);
                }
            } else if c.refusing && now > c.at + REHOME_BOUND {
                broken = Some((
                    "re-homed within the bound",
                    format!(
                        "{} crashed (port refusing) at {:?}; after {:?} removed everywhere: {removed_everywhere}, coordinator live: {coordinator_live}",
                        c.uid,
                        c.at,
                        now - c.at
                    ),
                ));
                c.done = true;
            }
        }
        self.stats.max_rehome_ms = longest;
        if let Some((inv, d)) = broken {
            self.violate(inv, d);
        }
    }

    fn check_step(&mut self) {
        self.check_rehome();
        let acting: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| {
                self.nodes[i]
                    .as_ref()
                    .is_some_and(|n| n.singleton && !n.paused && n.stopped.is_none())
            })
            .collect();
        if acting.len() > 1 {
            self.violate(
                "one coordinator",
                format!("nodes {acting:?} run the coordinator"),
            );
        }
    }

    fn next_time(&self) -> Option<Duration> {
        let mut t = self.packets.peek().map(|p| p.0.at);
        let mut take = |x: Option<Duration>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t: Duration| t.min(x)));
            }
        };
        take(self.script.front().map(|a| a.0));
        take(self.timed.iter().map(|a| a.0).min());
        take(Some(self.next_app));
        for n in self.nodes.iter().flatten() {
            if !n.paused && n.stopped.is_none() {
                take(n.cn.poll_timeout());
            }
        }
        t
    }

    /// Runs the script to the end and the final checks.
    pub fn run(&mut self) {
        let mut settled = false;
        while self.violation.is_none() {
            let Some(next) = self.next_time() else { break };
            if next > self.plan.run_until {
                break;
            }
            self.now = self.now.max(next);
            self.stats.steps += 1;
            if self.stats.steps > MAX_STEPS {
                self.violate("bounded", format!("more than {MAX_STEPS} steps"));
                break;
            }
            if !settled && self.now >= self.plan.settle_from {
                settled = true;
                self.cut.clear();
                self.net = NetParams::clean();
                self.log(|| "settle: network healed and clean".to_string());
            }
            while self.script.front().is_some_and(|a| a.0 <= self.now) {
                if let Some((_, a)) = self.script.pop_front() {
                    self.run_action(a);
                }
            }
            let now = self.now;
            let (due, rest): (Vec<_>, Vec<_>) = self.timed.drain(..).partition(|a| a.0 <= now);
            self.timed = rest;
            for (_, a) in due {
                self.run_action(a);
            }
            while self.packets.peek().is_some_and(|p| p.0.at <= self.now) {
                if let Some(Reverse(p)) = self.packets.pop() {
                    self.deliver(p);
                }
            }
            for slot in 0..self.nodes.len() {
                let due = self.nodes[slot].as_ref().is_some_and(|n| {
                    !n.paused
                        && n.stopped.is_none()
                        && n.cn.poll_timeout().is_some_and(|t| t <= now)
                });
                if due {
                    if let Some(n) = self.nodes[slot].as_mut() {
                        n.cn.handle_timeout(now);
                    }
                    self.drain(slot);
                }
            }
            if self.now >= self.next_app {
                self.next_app = self.now + APP_INTERVAL;
                self.app_tick();
            }
            self.check_step();
        }
        if self.violation.is_none() {
            self.check_end();
        }
    }

    fn check_end(&mut self) {
        let live: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.live(i).is_some_and(|n| !n.paused))
            .collect();
        // no split brain: no two live nodes see each other Down or removed
        for &a in &live {
            for &b in &live {
                if a == b {
                    continue;
                }
                let (na, nb) = (self.live(a).map(|n| &n.cn), self.live(b).map(|n| &n.cn));
                let (Some(na), Some(nb)) = (na, nb) else {
                    continue;
                };
                let b_ua = nb.self_address();
                let gone = na.gossip().tombstones.contains(b_ua)
                    || na
                        .gossip()
                        .member(b_ua)
                        .is_some_and(|m| m.status == MemberStatus::Down);
                if gone {
                    self.violate(
                        "no split brain",
                        format!("live node {a} considers live node {b} Down or removed"),
                    );
                    return;
                }
            }
        }
        // converged: same members, all Up and live
        let live_uas: BTreeSet<UniqueAddress> = live
            .iter()
            .filter_map(|&i| self.live(i).map(|n| n.cn.self_address().clone()))
            .collect();
        for &i in &live {
            let Some(n) = self.live(i) else { continue };
            let members: BTreeSet<UniqueAddress> = n.cn.gossip().members.keys().cloned().collect();
            let all_up =
                n.cn.gossip()
                    .members
                    .values()
                    .all(|m| m.status == MemberStatus::Up);
            if members != live_uas || !all_up {
                let view: Vec<String> =
                    n.cn.gossip()
                        .members
                        .values()
                        .map(|m| format!("{}={:?}", m.unique_address, m.status))
                        .collect();
                self.violate(
                    "converged",
                    format!(
                        "node {i} sees [{}], live nodes are {live:?}",
                        view.join(", ")
                    ),
                );
                return;
            }
        }
        let coordinators = live
            .iter()
            .filter(|&&i| self.live(i).is_some_and(|n| n.singleton))
            .count();
        if !live.is_empty() && coordinators != 1 {
            self.violate(
                "converged",
                format!("{coordinators} coordinators among live nodes {live:?}"),
            );
            return;
        }
        if self.plan.no_downing && self.stats.downed > 0 {
            self.violate(
                "no false downing",
                format!("{} nodes downed after a short pause", self.stats.downed),
            );
            return;
        }
        if let Some(p) = self.plan.long_pause {
            if self.live(p).is_some() {
                self.violate(
                    "paused stops first",
                    format!("node {p} was paused > 2 x stable_after and still runs"),
                );
                return;
            }
        }
        let live_set: BTreeSet<usize> = live.iter().copied().collect();
        match self.plan.expect.clone() {
            Expect::Survivors(want) => {
                if live_set != want {
                    self.violate(
                        "expected survivors",
                        format!("live nodes {live_set:?}, expected {want:?}"),
                    );
                }
            }
            Expect::AllStopped => {
                if !live_set.is_empty() {
                    self.violate(
                        "expected survivors",
                        format!("live nodes {live_set:?}, expected none"),
                    );
                }
            }
            Expect::Consistent => {}
            Expect::NoFalseDowning => {
                if self.stats.downed > 0 && !self.ever_unreachable {
                    self.violate(
                        "no false downing",
                        format!(
                            "{} nodes downed although no detector crossed its threshold",
                            self.stats.downed
                        ),
                    );
                }
            }
        }
    }

    /// The outcome.
    pub fn outcome(&self) -> MembershipOutcome {
        let mut o = self.stats.clone();
        o.violation = self.violation.clone();
        o.last_events = self.log.iter().cloned().collect();
        o
    }
}

/// Runs one scenario with one seed.
pub fn run_membership(scenario: &MembershipScenario, seed: u64, trace: bool) -> MembershipOutcome {
    let mut w = MembershipWorld::new(scenario, seed, trace);
    w.run();
    w.outcome()
}

// ----- scenarios -----

fn formed(nodes: usize) -> Plan {
    Plan {
        nodes,
        initial: (0..nodes).collect(),
        script: Vec::new(),
        run_until: s(90),
        settle_from: s(60),
        expect: Expect::Survivors((0..nodes).collect()),
        long_pause: None,
        no_downing: false,
        strategy: SbrStrategy::KeepMajority,
    }
}

/// Cluster formation takes the first seed's 5 s timeout plus a few gossip
/// rounds; faults start after this.
const FORMED_BY: Duration = Duration::from_secs(20);

fn shuffled(rng: &mut ChaCha8Rng, n: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = rng.gen_range(0..=i);
        v.swap(i, j);
    }
    v
}

fn partition_3_2(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let order = shuffled(rng, 5);
    let (major, minor) = (order[..3].to_vec(), order[3..].to_vec());
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    p.script
        .push((at, Action::Partition(vec![major.clone(), minor])));
    p.expect = Expect::Survivors(major.into_iter().collect());
    p
}

fn tie_2_2(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(4);
    let order = shuffled(rng, 4);
    let (a, b) = (order[..2].to_vec(), order[2..].to_vec());
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    p.script
        .push((at, Action::Partition(vec![a.clone(), b.clone()])));
    // the side with the lowest address (slot 0) survives
    let keep = if a.contains(&0) { a } else { b };
    p.expect = Expect::Survivors(keep.into_iter().collect());
    p
}

fn split_2_2_1(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let o = shuffled(rng, 5);
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    p.script.push((
        at,
        Action::Partition(vec![vec![o[0], o[1]], vec![o[2], o[3]], vec![o[4]]]),
    ));
    p.expect = Expect::AllStopped;
    p
}

fn asymmetric(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(3);
    let o = shuffled(rng, 3);
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    p.script.push((at, Action::CutLink(o[0], o[1])));
    // A and B are only indirectly connected (through C): both are downed.
    p.expect = Expect::Survivors(BTreeSet::from([o[2]]));
    p
}

fn flaky(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let loss = rng.gen_range(0.0..0.08);
    let spike = rng.gen_range(0.0..0.03);
    p.script.push((
        s(2),
        Action::Net(NetParams {
            latency: (ms(1), ms(40)),
            loss,
            spike,
            spike_max: ms(1500),
        }),
    ));
    p.run_until = s(150);
    p.settle_from = s(120);
    p.expect = Expect::NoFalseDowning;
    p
}

fn long_pause(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let victim = rng.gen_range(0..5);
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    // longer than twice stable_after plus detection and removal
    let pause = STABLE_AFTER * 2 + s(10) + ms(rng.gen_range(0..10_000));
    p.script.push((at, Action::Pause(victim)));
    p.script.push((at + pause, Action::Resume(victim)));
    p.long_pause = Some(victim);
    p.expect = Expect::Survivors((0..5).filter(|&i| i != victim).collect());
    p
}

fn join_crash(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(4);
    p.initial = vec![0, 1, 2];
    let rounds = 4;
    let mut t = FORMED_BY;
    for _ in 0..rounds {
        p.script.push((t, Action::CrashSoonAfterJoin(3)));
        t += s(20) + ms(rng.gen_range(0..5000));
    }
    p.script.push((t, Action::Start(3)));
    p.settle_from = t;
    p.run_until = t + s(40);
    p.expect = Expect::Survivors((0..4).collect());
    p
}

fn rolling_restart(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let mut t = FORMED_BY;
    let order = shuffled(rng, 5);
    for i in order {
        p.script.push((t, Action::Leave(i)));
        p.script.push((t + s(15), Action::ExpectLeft(i)));
        p.script.push((t + s(15) + ms(1), Action::Start(i)));
        t += s(30) + ms(rng.gen_range(0..3000));
    }
    p.settle_from = t;
    p.run_until = t + s(30);
    p.expect = Expect::Survivors((0..5).collect());
    p
}

fn brief_partition(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let order = shuffled(rng, 5);
    let cut = rng.gen_range(1..=2);
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    // heals anywhere from well before to just after the decision (detection
    // about 5 s plus stable_after 5 s)
    let heal = at + ms(rng.gen_range(2_000..14_000));
    p.script.push((
        at,
        Action::Partition(vec![order[..cut].to_vec(), order[cut..].to_vec()]),
    ));
    p.script.push((heal, Action::Heal));
    p.expect = Expect::Consistent;
    p
}

fn unstable(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let order = shuffled(rng, 5);
    p.script.push((
        FORMED_BY,
        Action::Net(NetParams {
            latency: (ms(1), ms(100)),
            loss: rng.gen_range(0.15..0.35),
            spike: rng.gen_range(0.0..0.1),
            spike_max: ms(3000),
        }),
    ));
    // and a partition in the middle of it, healed later
    let at = FORMED_BY + s(10) + ms(rng.gen_range(0..10_000));
    p.script.push((
        at,
        Action::Partition(vec![order[..2].to_vec(), order[2..].to_vec()]),
    ));
    p.script
        .push((at + ms(rng.gen_range(1_000..20_000)), Action::Heal));
    p.run_until = s(140);
    p.settle_from = s(100);
    p.expect = Expect::Consistent;
    p
}

fn keep_oldest(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = partition_3_2(rng);
    p.strategy = SbrStrategy::KeepOldest {
        down_if_alone: true,
    };
    // slot 0, the first seed, formed the cluster: it is the oldest
    if let Some((_, Action::Partition(groups))) = p.script.first() {
        let keep = groups
            .iter()
            .find(|g| g.contains(&0))
            .cloned()
            .unwrap_or_default();
        p.expect = Expect::Survivors(keep.into_iter().collect());
    }
    p
}

fn static_quorum(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = partition_3_2(rng);
    p.strategy = SbrStrategy::StaticQuorum { quorum_size: 3 };
    p
}

fn crash_process(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    // slot 0 formed the cluster: the oldest, which runs the coordinator,
    // is the victim in about one run of five
    let victim = rng.gen_range(0..5);
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    p.script.push((at, Action::CrashProcess(victim)));
    p.expect = Expect::Survivors((0..5).filter(|&i| i != victim).collect());
    p
}

fn crash_host(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let victim = rng.gen_range(0..5);
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    p.script.push((at, Action::Crash(victim)));
    p.expect = Expect::Survivors((0..5).filter(|&i| i != victim).collect());
    p
}

fn short_pause(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let victim = rng.gen_range(0..5);
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    // shorter than detection (acceptable heartbeat pause 3 s)
    let pause = ms(rng.gen_range(200..2_500));
    p.script.push((at, Action::Pause(victim)));
    p.script.push((at + pause, Action::Resume(victim)));
    p.no_downing = true;
    p
}

fn restart_same_address(rng: &mut ChaCha8Rng) -> Plan {
    let mut p = formed(5);
    let victim = rng.gen_range(0..5);
    let at = FORMED_BY + ms(rng.gen_range(0..3000));
    // the new incarnation starts before, around or after the old one is
    // downed
    let restart = at + ms(rng.gen_range(0..4_000));
    p.script.push((at, Action::CrashProcess(victim)));
    p.script.push((restart, Action::Start(victim)));
    p
}

/// Every membership scenario.
pub static MEMBERSHIP_SCENARIOS: &[MembershipScenario] = &[
    MembershipScenario {
        name: "membership-partition-3-2",
        about: "clean 3|2 partition: keep-majority downs the minority, which stops",
        build: partition_3_2,
    },
    MembershipScenario {
        name: "membership-tie-2-2",
        about: "2|2 partition: the side with the lowest address survives",
        build: tie_2_2,
    },
    MembershipScenario {
        name: "membership-split-2-2-1",
        about: "2|2|1 split: no side has a majority, every member downs itself",
        build: split_2_2_1,
    },
    MembershipScenario {
        name: "membership-asymmetric",
        about: "A cannot reach B, both reach C: the indirectly connected A and B are downed",
        build: asymmetric,
    },
    MembershipScenario {
        name: "membership-keep-oldest",
        about: "3|2 partition with keep-oldest: the side of the oldest member survives",
        build: keep_oldest,
    },
    MembershipScenario {
        name: "membership-static-quorum",
        about: "3|2 partition with static-quorum 3: the side with the quorum survives",
        build: static_quorum,
    },
    MembershipScenario {
        name: "membership-flaky",
        about: "lossy network with latency spikes: no downing unless phi crossed the threshold",
        build: flaky,
    },
    MembershipScenario {
        name: "membership-brief-partition",
        about: "a 4|1 or 3|2 partition heals around the decision time: one consistent outcome",
        build: brief_partition,
    },
    MembershipScenario {
        name: "membership-unstable",
        about: "heavy loss and spikes plus a partition: one consistent decision or down-all",
        build: unstable,
    },
    MembershipScenario {
        name: "membership-long-pause",
        about: "a member paused > 2 x stable_after resumes, learns it was downed, stops before serving",
        build: long_pause,
    },
    MembershipScenario {
        name: "membership-join-crash",
        about: "a node joins and crashes within one heartbeat interval, four times, then joins for good",
        build: join_crash,
    },
    MembershipScenario {
        name: "membership-rolling-restart",
        about: "every member leaves gracefully and restarts with a new uid, one at a time, under load",
        build: rolling_restart,
    },
    MembershipScenario {
        name: "membership-crash-process",
        about: "a process dies, its host stays up (port refuses): removed and re-homed within the bound",
        build: crash_process,
    },
    MembershipScenario {
        name: "membership-crash-host",
        about: "a whole host dies (timeouts only): the resolver's rules and stable_after apply",
        build: crash_host,
    },
    MembershipScenario {
        name: "membership-short-pause",
        about: "a process paused for less than the detection time (no refusal) comes back: nobody is downed",
        build: short_pause,
    },
    MembershipScenario {
        name: "membership-restart-same-address",
        about: "a process dies and a new incarnation starts at its address: the old one is gone within the bound",
        build: restart_same_address,
    },
];

/// Whether `name` is a membership scenario.
pub fn is_membership_scenario(name: &str) -> bool {
    MEMBERSHIP_SCENARIOS.iter().any(|s| s.name == name)
}

/// Prints the membership scenarios (for `sim --list`).
pub fn list_membership_scenarios() {
    for s in MEMBERSHIP_SCENARIOS {
        println!("{:<26} {}", s.name, s.about);
    }
}

/// Runs the membership scenarios (all, or only `only` when it names one)
/// over `seeds` on `threads` threads; prints one line per scenario and, for
/// the first failures, the seed, the scenario, the invariant, the replay
/// command and the last events. Returns (runs, violations).
pub fn run_membership_cli(only: Option<&str>, seeds: &[u64], threads: usize) -> (u64, u64) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let scenarios: Vec<&MembershipScenario> = MEMBERSHIP_SCENARIOS
        .iter()
        .filter(|s| only.is_none_or(|o| o == s.name))
        .collect();
    let mut runs = 0;
    let mut failures: Vec<(&MembershipScenario, u64)> = Vec::new();
    for sc in scenarios {
        let t0 = std::time::Instant::now();
        let next = AtomicU64::new(0);
        let mut results: Vec<(u64, MembershipOutcome)> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads.max(1))
                .map(|_| {
                    scope.spawn(|| {
                        let mut out = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                            let Some(&seed) = seeds.get(i) else { break };
                            out.push((seed, run_membership(sc, seed, false)));
                        }
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap_or_default())
                .collect()
        });
        results.sort_by_key(|(s, _)| *s);
        let (mut steps, mut packets, mut downed, mut starts, mut served, mut v) =
            (0, 0, 0, 0, 0, 0);
        let mut rehome = 0;
        for (seed, o) in &results {
            runs += 1;
            steps += o.steps;
            packets += o.packets;
            downed += o.downed;
            starts += o.coordinator_starts;
            served += o.served;
            rehome = rehome.max(o.max_rehome_ms);
            if o.violation.is_some() {
                v += 1;
                failures.push((sc, *seed));
            }
        }
        let rehome = if rehome > 0 {
            format!(", longest re-homing after a process crash {rehome} ms")
        } else {
            String::new()
        };
        println!(
            "{:<26} {} seeds, {v} violations  (packets {packets}, members downed {downed}, coordinator starts {starts}, requests served {served}{rehome}; steps {steps}) {:.1}s, {:.0} seeds/s",
            sc.name,
            results.len(),
            t0.elapsed().as_secs_f64(),
            results.len() as f64 / t0.elapsed().as_secs_f64().max(1e-9)
        );
    }
    for (sc, seed) in &failures {
        println!("FAILED scenario {} seed {seed}", sc.name);
    }
    for (sc, seed) in failures.iter().take(3) {
        let o = run_membership(sc, *seed, true);
        println!();
        match &o.violation {
            Some(v) => println!(
                "VIOLATION seed {seed} scenario {} invariant {:?} at {:.3}s: {}",
                sc.name,
                v.invariant,
                v.at.as_secs_f64(),
                v.detail
            ),
            None => println!(
                "seed {seed} scenario {}: replay did not violate (nondeterminism)",
                sc.name
            ),
        }
        println!(
            "replay: cargo run --release -p shardline-tests --bin sim -- --scenario {} --seed {seed}",
            sc.name
        );
        println!("last events:");
        for line in &o.last_events {
            println!("  {line}");
        }
    }
    (runs, failures.len() as u64)
}
