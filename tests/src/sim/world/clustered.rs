//! Clustered mode of the sharding world: every node runs the real
//! `ClusterNode` (gossip, phi-accrual failure detector, split-brain
//! resolver, coordinator singleton placement) instead of the script's
//! membership.
//!
//! - Membership messages travel over the same simulated links as sharding
//!   traffic, through the wire codec; a partition loses them (datagrams),
//!   latency applies as to every packet.
//! - Each node's regions and its coordinator get `MembershipEvent`s derived
//!   from that node's own `ClusterEvent`s: `MemberUp`/`MemberWeaklyUp` give
//!   `MemberUp`; `MemberLeft`/`MemberExited`/`MemberDowned` give
//!   `MemberLeaving` (no new shards; a downed member's shards move only once
//!   it is removed, after `down_removal_margin`); `MemberRemoved` gives
//!   `MemberRemoved`.
//! - The coordinator runs where `poll_singleton` says: it starts (recovering
//!   the journal) on `Start` and stops on `Stop`, which is confirmed with
//!   `handle_singleton_stopped`.
//! - A node whose `ClusterNode` stops (`Downed`) stops its regions and
//!   entities at once: everything it held is lost, the senders are told.
//! - A paused node gets no input at all; after it resumes its
//!   `ClusterNode` runs first, and the node's regions and entities stay
//!   frozen while it is fenced (`is_fenced`), so a node that was downed
//!   during its pause stops before it handles a single message.

use std::time::Duration;

use rand::Rng;
use shardline_core::cluster::{
    decode, encode, ClusterConfig, ClusterEvent, ClusterNode, DowningConfig,
    MemberStatus as CStatus, SbrConfig, SbrStrategy, SingletonCommand, StopReason,
};
use shardline_core::ids::{Address, UniqueAddress};
use shardline_core::sharding::{
    LeastShardAllocationStrategy, MemberStatus, MembershipEvent, ShardCoordinator,
};

use super::{Body, Ev, World};

/// `stable_after` of the split-brain resolver in clustered runs (the
/// membership simulation uses the same).
pub(crate) const STABLE_AFTER: Duration = Duration::from_secs(5);

fn sharding_status(s: CStatus) -> Option<MemberStatus> {
    match s {
        CStatus::WeaklyUp | CStatus::Up => Some(MemberStatus::Up),
        // A downed member keeps its shards until it is removed.
        CStatus::Leaving | CStatus::Exiting | CStatus::Down => Some(MemberStatus::Leaving),
        CStatus::Joining | CStatus::Removed => None,
    }
}

fn members_of(cn: &ClusterNode) -> Vec<(UniqueAddress, MemberStatus)> {
    cn.gossip()
        .members
        .values()
        .filter_map(|m| sharding_status(m.status).map(|s| (m.unique_address.clone(), s)))
        .collect()
}

impl World {
    fn address_of(slot: usize) -> Address {
        Address(format!("10.0.0.{}:7101", slot + 1))
    }

    pub(super) fn start_cluster_node(&mut self, slot: usize) {
        let seeds = (0..3).map(Self::address_of).collect();
        let mut cfg = ClusterConfig::new(self.nodes[slot].addr.clone(), seeds);
        let mut sbr = SbrConfig::with_stable_after(STABLE_AFTER);
        sbr.strategy = SbrStrategy::KeepMajority;
        cfg.downing = DowningConfig::SplitBrainResolver(sbr);
        cfg.random_seed = self.rng.gen();
        let mut cn = ClusterNode::new(cfg, self.nodes[slot].uid, self.now);
        cn.subscribe();
        self.nodes[slot].cn = Some(cn);
        self.drain_cluster(slot);
    }

    /// Frozen: paused, or fenced after a pause until a member answers.
    pub(super) fn frozen(&self, slot: usize) -> bool {
        let n = &self.nodes[slot];
        n.paused.is_some() || n.cn.as_ref().is_some_and(|c| c.is_fenced())
    }

    /// Holds an input of a frozen node; returns the event when it may run.
    pub(super) fn defer_if_frozen(&mut self, ev: Ev) -> Option<Ev> {
        if !self.p.clustered {
            return Some(ev);
        }
        let slot = match &ev {
            Ev::Arrive(p) => {
                let cluster = matches!(p.body, Body::Cluster(_));
                if cluster && self.nodes[p.to].paused.is_none() {
                    return Some(ev);
                }
                if self.nodes[p.to].uid != p.to_uid {
                    return Some(ev);
                }
                p.to
            }
            Ev::Process { slot, uid, .. } | Ev::Burst { slot, uid, .. } => {
                if self.nodes[*slot].uid != *uid {
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
        // membership messages queued during the pause.
        let now = self.now;
        if let Some(cn) = self.nodes[slot].cn.as_mut() {
            cn.handle_timeout(now);
        }
        self.drain_cluster(slot);
        let held = std::mem::take(&mut self.nodes[slot].deferred);
        let mut rest = Vec::new();
        for ev in held {
            match ev {
                Ev::Arrive(p) if matches!(p.body, Body::Cluster(_)) => {
                    if self.nodes[slot].alive {
                        if let Body::Cluster(b) = p.body {
                            self.cluster_arrive(slot, b);
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

    pub(super) fn cluster_arrive(&mut self, slot: usize, bytes: Vec<u8>) {
        let msg = match decode(&bytes) {
            Ok(m) => m,
            Err(e) => {
                return self.violate(
                    "codec",
                    format!("a packet to node {slot} did not decode: {e}"),
                )
            }
        };
        let now = self.now;
        if let Some(cn) = self.nodes[slot].cn.as_mut() {
            cn.handle_message(now, msg);
        }
        self.drain_cluster(slot);
    }

    pub(super) fn cluster_timer(&mut self, slot: usize) {
        let now = self.now;
        let n = &mut self.nodes[slot];
        if n.paused.is_some() {
            return;
        }
        let Some(cn) = n.cn.as_mut() else { return };
        if cn.poll_timeout().is_some_and(|t| t <= now) {
            cn.handle_timeout(now);
            self.drain_cluster(slot);
        }
    }

    /// Applies the effects of a node's `ClusterNode`.
    fn drain_cluster(&mut self, slot: usize) {
        let now = self.now;
        let Some(cn) = self.nodes[slot].cn.as_mut() else {
            return;
        };
        if let Some(r) = cn.poll_stop() {
            return self.cluster_stop(slot, r);
        }
        let self_down = cn.self_member().is_some_and(|m| m.status == CStatus::Down);
        if self_down {
            return self.violate(
                "downed stops",
                format!("node {slot} sees itself Down and has not stopped"),
            );
        }
        let mut transmits = Vec::new();
        while let Some(t) = cn.poll_transmit() {
            transmits.push(t);
        }
        let mut events = Vec::new();
        while let Some(e) = cn.poll_event() {
            events.push(e);
        }
        let mut singleton = Vec::new();
        while let Some(c) = cn.poll_singleton() {
            singleton.push(c);
        }
        for t in transmits {
            let Some(&to) = self.slot_of.get(&t.to) else {
                continue;
            };
            if !self.nodes[to].alive && !self.nodes[to].left {
                // Nobody listens there (the packet would be dropped anyway).
                continue;
            }
            let to_uid = self.nodes[to].uid;
            self.send(slot, to, to_uid, Body::Cluster(encode(&t.message)));
        }
        for e in events {
            let ev = match e {
                ClusterEvent::CurrentClusterState(_) => {
                    let cn = self.nodes[slot].cn.as_ref().expect("cluster node");
                    Some(MembershipEvent::CurrentMembers(members_of(cn)))
                }
                ClusterEvent::MemberUp(m) | ClusterEvent::MemberWeaklyUp(m) => {
                    Some(MembershipEvent::MemberUp(m.unique_address))
                }
                ClusterEvent::MemberLeft(m)
                | ClusterEvent::MemberExited(m)
                | ClusterEvent::MemberDowned(m) => {
                    Some(MembershipEvent::MemberLeaving(m.unique_address))
                }
                ClusterEvent::MemberRemoved { member, .. } => {
                    Some(MembershipEvent::MemberRemoved(member.unique_address))
                }
                _ => None,
            };
            if let Some(ev) = ev {
                self.log(|| format!("node {slot} membership: {ev:?}"));
                self.notify_local(slot, &ev);
            }
        }
        for c in singleton {
            match c {
                SingletonCommand::Start => self.start_coordinator_here(slot),
                SingletonCommand::Stop => {
                    self.log(|| format!("coordinator stops on node {slot}"));
                    self.nodes[slot].coordinator = None;
                    if self.coord_at.is_some_and(|(s, _)| s == slot) {
                        self.coord_at = None;
                    }
                    if let Some(cn) = self.nodes[slot].cn.as_mut() {
                        cn.handle_singleton_stopped(now);
                    }
                    // Its confirmation goes out now.
                    return self.drain_cluster(slot);
                }
            }
        }
        self.release(slot);
    }

    fn notify_local(&mut self, slot: usize, ev: &MembershipEvent) {
        for core in 0..self.nodes[slot].regions.len() {
            let now = self.now;
            self.nodes[slot].regions[core].handle_membership(now, ev);
            self.drain_region(slot, core);
        }
        if let Some(c) = self.nodes[slot].coordinator.as_mut() {
            c.handle_membership(self.now, ev.clone());
            self.drain_coordinator(slot);
        }
    }

    fn start_coordinator_here(&mut self, slot: usize) {
        self.log(|| format!("coordinator starts on node {slot}"));
        self.stats.coordinator_starts += 1;
        let mut c = ShardCoordinator::recover(
            self.p.coordinator.clone(),
            Box::new(LeastShardAllocationStrategy::default()),
            self.journal.iter(),
            self.now,
        );
        let cn = self.nodes[slot].cn.as_ref().expect("cluster node");
        c.handle_membership(self.now, MembershipEvent::CurrentMembers(members_of(cn)));
        self.nodes[slot].coordinator = Some(c);
        self.coord_at = Some((slot, self.nodes[slot].uid));
        self.drain_coordinator(slot);
        for s in 0..self.nodes.len() {
            if !self.nodes[s].alive {
                continue;
            }
            for core in 0..self.nodes[s].regions.len() {
                let now = self.now;
                self.nodes[s].regions[core].handle_coordinator_moved(now);
                self.drain_region(s, core);
            }
        }
    }

    /// The node's `ClusterNode` stopped: its regions, entities and
    /// coordinator stop at once.
    fn cluster_stop(&mut self, slot: usize, r: StopReason) {
        self.log(|| format!("node {slot} stops: {r:?}"));
        let n = &mut self.nodes[slot];
        n.alive = false;
        n.coordinator = None;
        n.deferred.clear();
        n.paused = None;
        if self.coord_at.is_some_and(|(s, _)| s == slot) {
            self.coord_at = None;
        }
        self.stats.downed += 1;
        self.lose_everything_at(slot, "node downed");
    }

    /// A node that acts after a pause longer than 2 x stable_after, or while
    /// another live member has removed it, breaks the membership contract.
    pub(super) fn check_may_act(&mut self, slot: usize, what: &str) {
        if !self.p.clustered {
            return;
        }
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
                && n.cn
                    .as_ref()
                    .is_some_and(|c| c.gossip().tombstones.contains(&me))
        });
        if let Some((o, _)) = zombie {
            self.violate(
                "no zombie",
                format!("node {slot} {what} although node {o} removed it"),
            );
        }
    }

    /// At most one coordinator acts (frozen nodes act on nothing).
    pub(super) fn check_one_coordinator(&mut self) {
        let mut acting = (0..self.nodes.len())
            .filter(|&s| self.nodes[s].alive && self.nodes[s].coordinator.is_some())
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
                let cn = self.nodes[s].cn.as_ref().expect("cluster node");
                cn.gossip()
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
            .filter(|&s| self.nodes[s].coordinator.is_some())
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
