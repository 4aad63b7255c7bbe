//! The control planes of the sharding world: every node runs the node's real
//! control plane (`shardline::plane::ControlPlane`), which owns the
//! `ClusterNode` (gossip, phi-accrual failure detector, split-brain
//! resolver, coordinator singleton placement), hosts the coordinator,
//! chooses where it recovers from and with which writer epoch, holds its
//! region messages until the journal says its events are durable, and runs
//! the graceful leave. The world carries the plane's outputs:
//!
//! - `poll_transmit`: control frames over the simulated links (same
//!   latency, FIFO per link); a partition loses membership frames
//!   (datagrams) and holds the others, as it holds sharding packets.
//! - `poll_to_cores`: region messages and membership changes for the
//!   node's regions; `Stop` stops the node.
//! - `poll_journal`: the world's coordinator journal (one, shared, as a
//!   database is): a recovery read is answered after a seed-chosen delay,
//!   as a file journal (the plane picks the epoch) or as the database (the
//!   read claims the next epoch); a begin or an append of an incarnation
//!   that is not the newest is refused (fenced); every write becomes durable
//!   after a seed-chosen delay, in order, and the plane is told
//!   (`handle_journal_durable`). A crash of the writer loses what was not
//!   durable yet.
//! - A paused node gets no input at all; after it resumes its plane runs
//!   first (timers, then the membership frames queued during the pause),
//!   and its regions and entities stay frozen while it is fenced
//!   (`is_fenced`), so a node downed during its pause stops before it
//!   handles a single message.

use std::path::PathBuf;
use std::time::Duration;

use rand::Rng;
use shardline::plane::{
    ControlEvent, ControlFrame, ControlPlane, ControlPlaneConfig, CoreCommand, JournalConfig,
    JournalOp, JournalSeq, RecoveredCoordinator, Recovery, ToCores, Transmit,
};
use shardline_core::cluster::{
    ClusterConfig, DowningConfig, MemberStatus as CStatus, SbrConfig, SbrStrategy,
};
use shardline_core::ids::{Address, MemberUid, RegionId, UniqueAddress};
use shardline_core::sharding::{
    CoordinatorEvent, CoordinatorMsg, CoordinatorState, RegionMsg, SHARD_ID_HASH_NAME,
};
use shardline_journal::WriterEpoch;

use super::{Body, Ev, Loc, Outcome, World};

/// `stable_after` of the split-brain resolver in clustered runs (the
/// membership simulation uses the same).
pub(crate) const STABLE_AFTER: Duration = Duration::from_secs(5);

/// The simulation's one entity type.
pub(crate) const TYPE: &str = "sim";

/// Milliseconds since the Unix epoch at virtual time zero (the wall clock
/// the world gives the planes).
const WALL_CLOCK_AT_ZERO_MS: u64 = 1_790_000_000_000;

/// The world's coordinator journal: the events of every incarnation, the
/// durable prefix, and the newest incarnation (its writer epoch and node).
#[derive(Default)]
pub(super) struct SimJournal {
    /// Coordinator events in append order.
    pub events: Vec<CoordinatorEvent>,
    /// How many of `events` are durable (count).
    pub durable: usize,
    /// The newest writer epoch begun or claimed (0: none).
    pub epoch: WriterEpoch,
    /// The node (slot, uid) of the newest incarnation.
    pub writer: Option<(usize, MemberUid)>,
}

impl World {
    fn address_of(slot: usize) -> Address {
        Address(format!("10.0.0.{}:7101", slot + 1).into())
    }

    fn wall_clock_ms(&self) -> u64 {
        WALL_CLOCK_AT_ZERO_MS + self.now.as_millis() as u64
    }

    fn plane_alive(&self, slot: usize, uid: MemberUid) -> bool {
        let n = &self.nodes[slot];
        n.alive && n.uid == uid && n.plane.is_some()
    }

    pub(super) fn start_cluster_node(&mut self, slot: usize) {
        let me = self.nodes[slot].member();
        let seeds = (0..3).map(Self::address_of).collect();
        let mut cluster = ClusterConfig::new(me.address.clone(), seeds);
        let mut sbr = SbrConfig::with_stable_after(STABLE_AFTER);
        sbr.strategy = SbrStrategy::KeepMajority;
        cluster.downing = DowningConfig::SplitBrainResolver(sbr);
        cluster.random_seed = self.rng.gen();
        let c = &self.p.coordinator;
        let cfg = ControlPlaneConfig {
            me,
            cluster,
            alone: false,
            data_cores: self.nodes[slot].data.len(),
            journal: JournalConfig {
                number_of_shards: self.cfg.shards,
                hash_name: SHARD_ID_HASH_NAME.to_string(),
            },
            coordinator: shardline::config::CoordinatorConfig {
                rebalance_interval_ms: c.rebalance_interval.as_millis() as u64,
                handoff_timeout_ms: c.handoff_timeout.as_millis() as u64,
                reregister_timeout_ms: c.reregister_timeout.as_millis() as u64,
                min_nr_of_members: c.min_nr_of_members,
                ..Default::default()
            },
            on_join_refused: Default::default(),
        };
        let now = self.now;
        let mut plane = ControlPlane::new(cfg, now);
        plane.handle_register_type(now, TYPE, self.p.region.remember_entities);
        self.nodes[slot].plane = Some(Box::new(plane));
        self.drive_plane(slot);
    }

    /// Frozen: paused, or fenced after a pause until a member answers.
    pub(super) fn frozen(&self, slot: usize) -> bool {
        let n = &self.nodes[slot];
        n.paused.is_some() || n.plane.as_ref().is_some_and(|p| p.cluster().is_fenced())
    }

    /// Holds an input of a frozen node; returns the event when it may run.
    pub(super) fn defer_if_frozen(&mut self, ev: Ev) -> Option<Ev> {
        let slot = match &ev {
            Ev::Arrive(p) => {
                let membership = matches!(&p.body, Body::Frame(f) if is_membership(f));
                if membership && self.nodes[p.to].paused.is_none() {
                    return Some(ev);
                }
                if self.nodes[p.to].uid != p.to_uid {
                    return Some(ev);
                }
                p.to
            }
            Ev::Process { slot, uid, .. }
            | Ev::Burst { slot, uid, .. }
            | Ev::LaneClosed { slot, uid, .. } => {
                if self.nodes[*slot].uid != *uid {
                    return Some(ev);
                }
                *slot
            }
            // The journal answers a paused process only once it runs again.
            Ev::JournalDurable { slot, uid, .. } | Ev::Recovered { slot, uid, .. } => {
                if self.nodes[*slot].uid != *uid || self.nodes[*slot].paused.is_none() {
                    return Some(ev);
                }
                *slot
            }
            _ => return Some(ev),
        };
        if self.nodes[slot].alive && self.frozen(slot) {
            self.nodes[slot].deferred.push(ev);
            None
        } else {
            Some(ev)
        }
    }

    /// Re-queues the held inputs of a node that is no longer frozen.
    fn release(&mut self, slot: usize) {
        if !self.nodes[slot].alive || self.frozen(slot) || self.nodes[slot].deferred.is_empty() {
            return;
        }
        let held = std::mem::take(&mut self.nodes[slot].deferred);
        self.log(|| format!("node {slot} thaws: {} held inputs", held.len()));
        for ev in held {
            self.schedule(self.now, ev);
        }
    }

    pub(super) fn pause(&mut self, slot: usize) {
        if self.nodes[slot].alive && self.nodes[slot].paused.is_none() {
            self.log(|| format!("node {slot} paused"));
            self.nodes[slot].paused = Some(self.now);
        }
    }

    pub(super) fn resume(&mut self, slot: usize) {
        let Some(since) = self.nodes[slot].paused else {
            return;
        };
        if !self.nodes[slot].alive {
            return;
        }
        self.nodes[slot].paused = None;
        self.nodes[slot].long_resumed = self.now - since > STABLE_AFTER * 2;
        let paused_for = self.now - since;
        self.log(|| format!("node {slot} resumes after {paused_for:?}"));
        // The membership state machine runs first: timers, then the
        // membership frames queued during the pause.
        let now = self.now;
        if let Some(p) = self.nodes[slot].plane.as_mut() {
            p.handle_timeout(now);
        }
        self.drive_plane(slot);
        let held = std::mem::take(&mut self.nodes[slot].deferred);
        let mut rest = Vec::new();
        for ev in held {
            match ev {
                Ev::Arrive(p) if matches!(&p.body, Body::Frame(f) if is_membership(f)) => {
                    if self.nodes[slot].alive {
                        if let Body::Frame(f) = p.body {
                            self.frame_arrive(slot, *f);
                        }
                    }
                }
                other => rest.push(other),
            }
        }
        if self.nodes[slot].alive {
            self.nodes[slot].deferred = rest;
            self.release(slot);
        }
    }

    /// A control frame reached `slot`'s plane.
    pub(super) fn frame_arrive(&mut self, slot: usize, f: ControlFrame) {
        let now = self.now;
        let Some(p) = self.nodes[slot].plane.as_mut() else {
            return;
        };
        if let Err(e) = p.handle_frame(now, f) {
            return self.violate("codec", format!("a frame to node {slot} failed: {e}"));
        }
        self.drive_plane(slot);
    }

    /// The plane's timers, when due.
    pub(super) fn plane_timer(&mut self, slot: usize) {
        let now = self.now;
        let n = &mut self.nodes[slot];
        if n.paused.is_some() {
            return;
        }
        let Some(p) = n.plane.as_mut() else { return };
        if p.poll_timeout().is_some_and(|t| t <= now) {
            p.handle_timeout(now);
            self.drive_plane(slot);
        }
    }

    /// A region of `slot` sends its coordinator `msg` (through its plane).
    /// With `dup_shard_stopped`, a `ShardStopped` reaches the coordinator
    /// once more, 3-20 s later.
    pub(super) fn plane_to_coordinator(&mut self, slot: usize, msg: CoordinatorMsg) {
        if self.p.dup_shard_stopped && matches!(msg, CoordinatorMsg::ShardStopped { .. }) {
            let d = Duration::from_millis(self.rng.gen_range(3000..=20_000));
            self.schedule(self.now + d, Ev::DupToCoordinator(msg.clone()));
        }
        let now = self.now;
        if let Some(p) = self.nodes[slot].plane.as_mut() {
            p.handle_to_coordinator(now, TYPE, msg);
            self.drive_plane(slot);
        }
    }

    /// A late duplicate of a region's message reaches the plane that runs
    /// the coordinator now, as a frame from another member does.
    pub(super) fn dup_to_coordinator(&mut self, msg: CoordinatorMsg) {
        let Some(s) = (0..self.nodes.len()).find(|&s| self.runs_coordinator(s)) else {
            return;
        };
        if self.frozen(s) {
            return;
        }
        self.log(|| format!("late duplicate to the coordinator on node {s}: {msg:?}"));
        let f = ControlFrame::ToCoordinator {
            type_name: TYPE.to_string(),
            msg: (&msg).into(),
        };
        self.frame_arrive(s, f);
    }

    /// A region of `slot` sends region `to` `msg` (through its plane).
    pub(super) fn plane_to_region(&mut self, slot: usize, to: RegionId, msg: RegionMsg) {
        let now = self.now;
        if let Some(p) = self.nodes[slot].plane.as_mut() {
            p.handle_to_region(now, TYPE, to, msg);
            self.drive_plane(slot);
        }
    }

    /// A graceful leave of `slot` through its plane.
    pub(super) fn plane_leave(&mut self, slot: usize) {
        let n = &self.nodes[slot];
        if !n.alive || n.leaving.is_some() || n.plane.is_none() {
            return;
        }
        let member = n.member();
        let timeout = self.p.leave_timeout;
        self.log(|| format!("node {slot} ({member}) leaves (timeout {timeout:?})"));
        self.nodes[slot].leaving = Some(self.now);
        let now = self.now;
        if let Some(p) = self.nodes[slot].plane.as_mut() {
            p.handle_leave(now, timeout);
        }
        let uid = self.nodes[slot].uid;
        // The leave must be over (the node stopped) by then.
        self.schedule(
            now + timeout + Duration::from_secs(30),
            Ev::LeaveDeadline(slot, uid),
        );
        self.drive_plane(slot);
    }

    pub(super) fn leave_deadline(&mut self, slot: usize, uid: MemberUid) {
        if self.plane_alive(slot, uid) && self.nodes[slot].leaving.is_some() {
            let timeout = self.p.leave_timeout;
            self.violate(
                "left",
                format!("node {slot} still runs 30 s after its leave timeout of {timeout:?}"),
            );
        }
    }

    /// Carries out everything `slot`'s plane handed out, until its queues
    /// are empty (the order of calls of the plane's module doc).
    pub(super) fn drive_plane(&mut self, slot: usize) {
        // Re-entrant calls (a data plane output that feeds the plane while its
        // outputs are carried out) queue on the plane; the outer loop
        // drains them.
        if self.nodes[slot].driving {
            return;
        }
        self.nodes[slot].driving = true;
        loop {
            if !self.nodes[slot].alive {
                break;
            }
            let Some(p) = self.nodes[slot].plane.as_mut() else {
                break;
            };
            if let Some(ev) = p.poll_event() {
                self.plane_event(slot, ev);
                continue;
            }
            if let Some(t) = p.poll_transmit() {
                self.plane_transmit(slot, t);
                continue;
            }
            if let Some(c) = p.poll_to_cores() {
                self.plane_to_cores(slot, c);
                continue;
            }
            if let Some(op) = p.poll_journal() {
                self.plane_journal(slot, op);
                continue;
            }
            let down = p
                .cluster()
                .self_member()
                .is_some_and(|m| m.status == CStatus::Down);
            if down && !p.is_stopped() {
                self.violate(
                    "downed stops",
                    format!("node {slot} sees itself Down and has not stopped"),
                );
            }
            break;
        }
        if slot < self.nodes.len() {
            self.nodes[slot].driving = false;
        }
        self.release(slot);
    }

    fn plane_event(&mut self, slot: usize, ev: ControlEvent) {
        match ev {
            ControlEvent::Stopped { code, refusal } => {
                self.log(|| format!("node {slot} stops: code {code} {refusal:?}"));
                self.plane_stop(slot, code);
            }
            ControlEvent::LeaveDone if self.nodes[slot].alive => {
                // `Node::leave` stops the process at the deadline even
                // though the member did not leave: the others down it.
                self.log(|| format!("node {slot} gave its leave up at the deadline; it stops"));
                self.stats.leaves_given_up += 1;
                let n = &mut self.nodes[slot];
                n.alive = false;
                n.deferred.clear();
                n.paused = None;
                self.lose_everything_at(slot, "leave given up");
            }
            ControlEvent::Cluster(e) => {
                self.log(|| format!("node {slot} cluster event {e:?}"));
            }
            // Readiness, the cluster id and admin answers concern the fronts.
            _ => {}
        }
    }

    fn plane_transmit(&mut self, slot: usize, t: Transmit) {
        let Some(&to) = self.slot_of.get(&Address(t.to.clone().into())) else {
            return;
        };
        if !self.nodes[to].alive && !self.nodes[to].left {
            // Nobody listens there (the packet would be dropped anyway).
            return;
        }
        let to_uid = self.nodes[to].uid;
        self.send(slot, to, to_uid, Body::Frame(Box::new(t.frame)));
    }

    fn plane_to_cores(&mut self, slot: usize, c: ToCores) {
        let now = self.now;
        match c {
            ToCores::Region { core, msg, .. } => {
                let core = usize::from(core);
                if core >= self.nodes[slot].data.len() {
                    return;
                }
                self.check_durable(slot, core, &msg);
                self.log(|| format!("plane {slot} -> region {slot}/{core}: {msg:?}"));
                self.nodes[slot].data[core].handle_region_msg(now, TYPE, msg);
                self.drive_core(slot, core);
            }
            ToCores::All(CoreCommand::Membership(ev)) => {
                self.log(|| format!("node {slot} membership: {ev:?}"));
                for core in 0..self.nodes[slot].data.len() {
                    if !self.nodes[slot].alive {
                        break;
                    }
                    self.nodes[slot].data[core].handle_membership(now, &ev);
                    self.drive_core(slot, core);
                }
            }
            ToCores::All(CoreCommand::CoordinatorMoved) => {
                for core in 0..self.nodes[slot].data.len() {
                    if !self.nodes[slot].alive {
                        break;
                    }
                    self.nodes[slot].data[core].handle_coordinator_moved(now);
                    self.drive_core(slot, core);
                }
            }
            ToCores::All(CoreCommand::GracefulShutdown) => {
                let n = self.nodes[slot].data.len();
                self.nodes[slot].handed_off = vec![false; n];
                for core in 0..n {
                    if !self.nodes[slot].alive {
                        break;
                    }
                    self.nodes[slot].data[core].handle_graceful_shutdown(now);
                    self.drive_core(slot, core);
                }
            }
            ToCores::All(CoreCommand::Stop) => self.plane_stop(slot, 2),
            // Whether the fronts take requests: the workload sends anyway.
            ToCores::All(CoreCommand::Available(_)) => {}
        }
    }

    /// "durable first": a region learns a shard's home only once the
    /// allocation is durable in the journal.
    fn check_durable(&mut self, slot: usize, core: usize, msg: &RegionMsg) {
        let homes: Vec<_> = match msg {
            RegionMsg::ShardHome {
                shard,
                region,
                generation,
            } => vec![(*shard, region.clone(), *generation)],
            RegionMsg::ShardHomes { homes } => homes.clone(),
            _ => return,
        };
        for (shard, region, generation) in homes {
            if !self
                .durable_allocs
                .contains(&(shard, region.clone(), generation))
            {
                return self.violate(
                    "durable first",
                    format!(
                        "region {slot}/{core} told shard {shard} is at {region} ({generation}) before the journal made that durable"
                    ),
                );
            }
        }
    }

    fn plane_journal(&mut self, slot: usize, op: JournalOp) {
        let uid = self.nodes[slot].uid;
        match op {
            JournalOp::Recover { type_name } => {
                let d = rand_between(&mut self.rng, self.p.recovery_delay);
                self.log(|| format!("node {slot} recovers {type_name} (answer in {d:?})"));
                self.schedule(self.now + d, Ev::Recovered { slot, uid });
            }
            JournalOp::Begin {
                epoch, seq, state, ..
            } => {
                let j = &self.journal_of_record;
                let newest = j.epoch;
                let claimed_here = j.writer == Some((slot, uid)) && epoch == newest;
                if epoch > newest || claimed_here {
                    self.log(|| format!("journal: node {slot} begins epoch {}", epoch.0));
                    self.stats.coordinator_starts += 1;
                    self.begin_from(slot, &state);
                    let j = &mut self.journal_of_record;
                    j.epoch = epoch;
                    j.writer = Some((slot, uid));
                    let len = j.events.len();
                    self.nodes[slot].seq_len.push((seq, len));
                    self.flush_later(slot, seq);
                } else {
                    let why = format!(
                        "writer epoch {} is not above the newest, {}",
                        epoch.0, newest.0
                    );
                    self.log(|| format!("journal: node {slot} begin refused: {why}"));
                    let now = self.now;
                    if let Some(p) = self.nodes[slot].plane.as_mut() {
                        p.handle_journal_refused(now, TYPE, why);
                    }
                }
            }
            JournalOp::Append {
                epoch, event, seq, ..
            } => {
                let j = &self.journal_of_record;
                if j.epoch != epoch || j.writer != Some((slot, uid)) {
                    let why = format!("fenced: epoch {} is newer than {}", j.epoch.0, epoch.0);
                    self.log(|| format!("journal: node {slot} append refused: {why}"));
                    let now = self.now;
                    if let Some(p) = self.nodes[slot].plane.as_mut() {
                        p.handle_journal_refused(now, TYPE, why);
                    }
                    return;
                }
                self.note_allocation(&event);
                self.log(|| format!("journal: node {slot} appends {event:?} as {}", seq.0));
                let j = &mut self.journal_of_record;
                j.events.push(event);
                let len = j.events.len();
                self.nodes[slot].seq_len.push((seq, len));
                self.flush_later(slot, seq);
            }
            // Every write is acknowledged in order (`flush_later`), which
            // covers the notification asked for.
            JournalOp::NotifyDurable { .. } => {}
            // The journal is one log; a snapshot folds the same state.
            JournalOp::SaveSnapshot { .. } | JournalOp::End { .. } => {}
        }
    }

    /// "recovery source": a new incarnation starts from the journal's
    /// state when the journal holds any; from another (the copy replicated
    /// to its member) only when it holds none, and then that state is the
    /// incarnation's first record.
    fn begin_from(&mut self, slot: usize, state: &CoordinatorState) {
        let j = &mut self.journal_of_record;
        let mut fold = CoordinatorState::default();
        for e in &j.events {
            fold.apply(e);
        }
        if fold == *state {
            return;
        }
        if !j.events.is_empty() {
            return self.violate(
                "recovery source",
                format!(
                    "node {slot} began an incarnation from a state other than the journal's ({} shards, the journal {})",
                    state.shards.len(),
                    fold.shards.len()
                ),
            );
        }
        self.stats.replicated_starts += 1;
        j.events = shardline::plane::snapshot_events(state);
        j.durable = 0;
        self.latest_alloc.iter_mut().for_each(|a| *a = None);
        for (shard, (region, generation)) in &state.shards {
            if let Some(a) = self.latest_alloc.get_mut(shard.0 as usize) {
                *a = Some((region.clone(), *generation));
            }
        }
    }

    /// The write `seq` of `slot` becomes durable after a seed-chosen delay,
    /// after every earlier write of that node.
    fn flush_later(&mut self, slot: usize, seq: JournalSeq) {
        let d = rand_between(&mut self.rng, self.p.journal_ack);
        let at = (self.now + d).max(self.nodes[slot].last_flush);
        self.nodes[slot].last_flush = at;
        let uid = self.nodes[slot].uid;
        self.schedule(at, Ev::JournalDurable { slot, uid, seq });
    }

    pub(super) fn journal_durable(&mut self, slot: usize, uid: MemberUid, seq: JournalSeq) {
        if !self.plane_alive(slot, uid) {
            return;
        }
        let upto = self.nodes[slot]
            .seq_len
            .iter()
            .filter(|(s, _)| *s <= seq)
            .map(|(_, l)| *l)
            .max();
        self.nodes[slot].seq_len.retain(|(s, _)| *s > seq);
        if let Some(upto) = upto {
            let j = &mut self.journal_of_record;
            if upto > j.durable {
                let from = j.durable;
                j.durable = upto;
                for e in &j.events[from..upto] {
                    if let CoordinatorEvent::ShardHomeAllocated {
                        shard,
                        region,
                        generation,
                    } = e
                    {
                        if shard.0 >= self.cfg.shards {
                            continue;
                        }
                        self.durable_allocs
                            .insert((*shard, region.clone(), *generation));
                    }
                }
            }
        }
        let now = self.now;
        if let Some(p) = self.nodes[slot].plane.as_mut() {
            p.handle_journal_durable(now, seq);
        }
        self.drive_plane(slot);
    }

    /// Answers `slot`'s recovery read from the journal as it is now: as a
    /// file journal (the plane picks the writer epoch) or, in
    /// `p_database` of the reads, as the database, which claims the next
    /// epoch for the reader at once (fencing every older incarnation).
    pub(super) fn recovered(&mut self, slot: usize, uid: MemberUid) {
        if !self.plane_alive(slot, uid) {
            return;
        }
        let database = self.p.p_database > 0.0 && self.rng.gen_bool(self.p.p_database);
        let j = &mut self.journal_of_record;
        let mut state = CoordinatorState::default();
        for e in &j.events {
            state.apply(e);
        }
        let claimed_epoch = database.then(|| WriterEpoch(j.epoch.0 + 1));
        if let Some(e) = claimed_epoch {
            j.epoch = e;
            j.writer = Some((slot, uid));
        }
        let held = !j.events.is_empty();
        let rec = RecoveredCoordinator {
            state,
            config: None,
            source: held.then(|| PathBuf::from("sim-journal")),
            records: j.events.len() as u64,
            highest_epoch: if database { WriterEpoch(0) } else { j.epoch },
            journals: usize::from(held),
            claimed_epoch,
            from_database: database,
        };
        let records = rec.records;
        self.log(|| {
            format!("journal: node {slot} read {records} records (database: {database}, claimed {claimed_epoch:?})")
        });
        let now = self.now;
        let wall = self.wall_clock_ms();
        if let Some(p) = self.nodes[slot].plane.as_mut() {
            p.handle_recovered(now, wall, TYPE, Recovery::Read(rec));
        }
        self.drive_plane(slot);
    }

    /// `slot` crashed: when it wrote the journal, what was not durable is
    /// lost.
    pub(super) fn journal_writer_crashed(&mut self, slot: usize, uid: MemberUid) {
        let j = &mut self.journal_of_record;
        if j.writer != Some((slot, uid)) || j.events.len() == j.durable {
            return;
        }
        let lost = j.events.len() - j.durable;
        j.events.truncate(j.durable);
        self.latest_alloc.iter_mut().for_each(|a| *a = None);
        for e in &j.events {
            match e {
                CoordinatorEvent::ShardHomeAllocated {
                    shard,
                    region,
                    generation,
                } => {
                    if let Some(a) = self.latest_alloc.get_mut(shard.0 as usize) {
                        *a = Some((region.clone(), *generation));
                    }
                }
                CoordinatorEvent::ShardHomeDeallocated { shard, .. } => {
                    if let Some(a) = self.latest_alloc.get_mut(shard.0 as usize) {
                        *a = None;
                    }
                }
                _ => {}
            }
        }
        self.stats.journal_lost += lost as u64;
        self.log(|| format!("journal: {lost} events of node {slot} were not durable and are lost"));
    }

    /// The node's plane stopped it (left, downed, refused) or told its
    /// cores to stop: its regions, entities and coordinator stop at once.
    fn plane_stop(&mut self, slot: usize, code: u8) {
        if !self.nodes[slot].alive {
            return;
        }
        let graceful = code == 1 && self.nodes[slot].leaving.is_some();
        let all_handed_off = self.nodes[slot].handed_off.iter().all(|d| *d);
        if graceful && all_handed_off {
            // Every shard was handed off: no message may be left here.
            let here = self
                .ledger
                .iter()
                .filter(|r| r.outcome == Outcome::Pending)
                .filter(|r| match r.loc {
                    Loc::Region(s) | Loc::Mailbox(s) | Loc::Link(_, s) => s == slot,
                    Loc::Done => false,
                })
                .count();
            if here > 0 {
                self.violate(
                    "exactly once",
                    format!("{here} messages lost when node {slot} left gracefully"),
                );
            }
        }
        // The data cores answer what they still hold (the stop drain);
        // what they send before the process exits still arrives.
        self.stop_cores(slot);
        let n = &mut self.nodes[slot];
        n.alive = false;
        n.flushed = true;
        n.deferred.clear();
        n.paused = None;
        if graceful {
            n.left = true;
            // A leave whose hand-offs timed out loses what its entities
            // still held; the senders are told.
            let why = if all_handed_off {
                "node left"
            } else {
                "leave timed out"
            };
            self.log(|| format!("node {slot} left ({why})"));
            self.lose_everything_at(slot, why);
        } else {
            self.stats.downed += 1;
            self.lose_everything_at(slot, "node downed");
        }
    }

    /// A node that acts after a pause longer than 2 x stable_after, or while
    /// another live member has removed it, breaks the membership contract.
    pub(super) fn check_may_act(&mut self, slot: usize, what: &str) {
        if self.nodes[slot].long_resumed {
            return self.violate(
                "paused stops first",
                format!("node {slot} {what} after a pause longer than 2 x stable_after"),
            );
        }
        let me = self.nodes[slot].member();
        let zombie = self.nodes.iter().enumerate().find(|(o, n)| {
            *o != slot
                && n.alive
                && n.plane
                    .as_ref()
                    .is_some_and(|p| p.cluster().gossip().tombstones.contains(&me))
        });
        if let Some((o, _)) = zombie {
            self.violate(
                "no zombie",
                format!("node {slot} {what} although node {o} removed it"),
            );
        }
    }

    /// Whether `slot`'s plane runs the coordinator.
    pub(super) fn runs_coordinator(&self, slot: usize) -> bool {
        let n = &self.nodes[slot];
        n.alive
            && n.plane
                .as_ref()
                .is_some_and(|p| p.coordinator(TYPE).is_some())
    }

    /// At most one coordinator acts (frozen nodes act on nothing).
    pub(super) fn check_one_coordinator(&mut self) {
        let mut acting = (0..self.nodes.len())
            .filter(|&s| self.runs_coordinator(s))
            .filter(|&s| !self.frozen(s));
        if let (Some(a), Some(b)) = (acting.next(), acting.next()) {
            self.violate(
                "one coordinator",
                format!("nodes {a} and {b} run the coordinator"),
            );
        }
    }

    /// End of a clustered run: the expected survivors run, the others
    /// stopped; the survivors agree on the members; every allocated shard is
    /// homed at a live region of a survivor.
    pub(super) fn check_clustered_end(&mut self) {
        let live: Vec<usize> = (0..self.nodes.len())
            .filter(|&s| self.nodes[s].alive)
            .collect();
        if let Some(expect) = self.p.expect_survivors.clone() {
            if live != expect {
                return self.violate(
                    "survivors",
                    format!("nodes {live:?} run at the end, expected {expect:?}"),
                );
            }
        }
        let views: Vec<Vec<UniqueAddress>> = live
            .iter()
            .map(|&s| {
                let p = self.nodes[s].plane.as_ref().expect("plane");
                p.cluster()
                    .gossip()
                    .members
                    .values()
                    .filter(|m| m.status == CStatus::Up)
                    .map(|m| m.unique_address.clone())
                    .collect()
            })
            .collect();
        let actual: Vec<UniqueAddress> = live.iter().map(|&s| self.nodes[s].member()).collect();
        for (i, v) in views.iter().enumerate() {
            if *v != actual {
                return self.violate(
                    "converged",
                    format!(
                        "node {} sees Up members {v:?}, live are {actual:?}",
                        live[i]
                    ),
                );
            }
        }
        let coords: Vec<usize> = live
            .iter()
            .copied()
            .filter(|&s| self.runs_coordinator(s))
            .collect();
        if coords.len() != 1 {
            return self.violate(
                "converged",
                format!("nodes {coords:?} run the coordinator at the end"),
            );
        }
        for (shard, home) in self.latest_alloc.iter().enumerate() {
            if let Some((r, _)) = home {
                let ok = self
                    .slot_of
                    .get(&r.member.address)
                    .is_some_and(|&s| self.nodes[s].alive && self.nodes[s].uid == r.member.uid);
                if !ok {
                    return self.violate(
                        "re-homed",
                        format!("shard {shard} is still homed at {r} at the end"),
                    );
                }
            }
        }
    }
}

/// Whether `f` is a membership message (a datagram: a partition loses it).
pub(super) fn is_membership(f: &ControlFrame) -> bool {
    matches!(f, ControlFrame::Cluster { .. })
}

fn rand_between(rng: &mut impl Rng, (lo, hi): (Duration, Duration)) -> Duration {
    if hi <= lo {
        lo
    } else {
        Duration::from_micros(rng.gen_range(lo.as_micros() as u64..=hi.as_micros() as u64))
    }
}
