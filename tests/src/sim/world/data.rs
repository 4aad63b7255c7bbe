//! The data planes of the sharding world: every data core of every node
//! runs the node's real data plane (`shardline::plane::data::DataPlane`),
//! which owns the core's `ShardRegion` and interprets its effects (the
//! forwarding bookkeeping and its deadlines, the data lanes and their
//! backoff, the registration and hand-off reports to the control plane,
//! the node's stop). The world carries the plane's outputs, as the node's
//! data executor does:
//!
//! - `Transmit`: the frame is encoded as on a data lane and goes over the
//!   simulated link of the lane the plane opened (`OpenLink`; one
//!   connection id per lane, which the remote plane answers to); a lane to
//!   a member that is gone fails to connect (`handle_link_closed`,
//!   `connected: false`), a lane whose remote crashes or stops breaks
//!   (`connected: true`) after a network latency; `CloseLink` closes it.
//! - `Reply`: to a simulated client (the ledger learns the answer), to an
//!   inbound lane (a `Reply` frame back over the link) or to another core
//!   of the node (its ring: the same node's link).
//! - `ToCore`: the other core's ring (the same node's link).
//! - `ToControl`: the node's control plane (`handle_to_coordinator`,
//!   `handle_to_region`, `handle_registered`, `handle_shutdown_complete`).
//! - `Deliver`, `StartEntity`, `StopEntity`: the world's test entities
//!   (mailboxes processed one message at a time, after a seed-chosen
//!   delay); an entity answers the sender of every message it processed
//!   (`Ok`), asks to passivate, and reports its stop
//!   (`handle_entity_stopped`).
//! - `Persist`, `RecoverRememberedEntities`: the world's remembered
//!   entities (one store, shared, as a database is).
//!
//! A message's payload is its ledger id (8 bytes, little endian); its
//! sender is `ReplyTo::Client { conn: simulated sender, request_id: ledger
//! id }` on the core it was sent to.

use std::time::Duration;

use rand::Rng;
use shardline::plane::data::{
    encode_frame, DataFrame, DataOutput, DataPlane, DataPlaneConfig, ReplyTo, Status, ToControl,
    Transmit, TypeIdx, UserEnvelope, FRAME_HEADER_BYTES,
};
use shardline_core::ids::{EntityId, MemberUid, RegionId, ShardId};
use shardline_core::sharding::{shard_id_of, ShardEvent};

use super::{clustered::TYPE, Body, Ev, Item, Loc, Outcome, World};

/// The simulation's one entity type on every core.
pub(super) const TY: TypeIdx = TypeIdx(0);

/// An open (or connecting) data lane of a core, as the world knows it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Lane {
    /// Which lane this is (a newer lane to the same region has a higher
    /// one): a close of an older lane is not the current one's.
    pub generation: u64,
    /// The connection id the remote plane answers to.
    pub conn: u64,
}

/// The ledger id a message's payload carries.
pub(super) fn msg_id(payload: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(payload.try_into().ok()?))
}

impl World {
    /// A data plane for core `core` of `slot` with the world's entity type
    /// registered (`proxy`: it routes and hosts nothing); its outputs are
    /// carried out once the node's control plane runs.
    pub(super) fn new_data_plane(&self, slot: usize, core: usize, proxy: bool) -> DataPlane {
        let mut p = DataPlane::new(DataPlaneConfig {
            me: self.region_id(slot, core),
            number_of_shards: self.cfg.shards,
            ask_timeout: Duration::from_secs(5),
            max_message_size_bytes: 1024,
            warm_allocation: true,
        });
        p.handle_register_type(self.now, TYPE, self.p.region.clone(), !proxy, false);
        p
    }

    /// Carries out everything core `core` of `slot` handed out, until it
    /// has nothing more (the order of calls of the plane's module doc).
    /// A re-entrant call (an output that fed the same plane) returns: the
    /// outer loop drains what it queued.
    pub(super) fn drive_core(&mut self, slot: usize, core: usize) {
        if self.nodes[slot].driving_core[core] {
            return;
        }
        self.nodes[slot].driving_core[core] = true;
        loop {
            if !self.nodes[slot].alive {
                break;
            }
            let now = self.now;
            let Some(o) = self.nodes[slot].data[core].poll_output(now) else {
                break;
            };
            self.carry_out(slot, core, o);
        }
        if slot < self.nodes.len() && core < self.nodes[slot].driving_core.len() {
            self.nodes[slot].driving_core[core] = false;
        }
    }

    fn carry_out(&mut self, slot: usize, core: usize, o: DataOutput) {
        self.log(|| format!("core {slot}/{core} -> {}", describe(&o)));
        match o {
            DataOutput::Reply {
                to,
                status,
                payload,
            } => self.reply(slot, core, to, status, payload),
            DataOutput::ToControl(m) => self.data_to_control(slot, core, m),
            DataOutput::OpenLink { to } => self.open_lane(slot, core, to),
            DataOutput::CloseLink { to } => {
                self.log(|| format!("core {slot}/{core} closes its lane to {to}"));
                if let Some(l) = self.lanes.remove(&(slot, core, to.clone())) {
                    let uid = self.nodes[slot].uid;
                    self.schedule(
                        self.now,
                        Ev::LaneClosed {
                            slot,
                            uid,
                            core,
                            to,
                            generation: l.generation,
                            connected: true,
                        },
                    );
                }
            }
            DataOutput::Transmit(t) => self.transmit_data(slot, core, t),
            DataOutput::ToCore {
                core: to_core,
                type_name,
                envelope,
            } => {
                let to_core = usize::from(to_core);
                if to_core >= self.nodes[slot].data.len() {
                    self.nodes[slot].data[core].handle_core_refused(envelope);
                    return;
                }
                if let Some(id) = msg_id(&envelope.payload) {
                    self.ledger[id as usize].loc = Loc::Link(slot, slot);
                }
                let uid = self.nodes[slot].uid;
                let body = Body::ToCore {
                    core: to_core,
                    type_name: type_name.to_string(),
                    envelope,
                };
                self.send(slot, slot, uid, body);
            }
            DataOutput::Deliver { envelope, .. } => self.deliver(slot, core, envelope),
            DataOutput::StartEntity { entity, .. } => {
                if !self.nodes[slot].actors[core].contains_key(&entity) {
                    self.create_actor(slot, core, &entity);
                }
            }
            DataOutput::StopEntity { shard, entity, .. } => {
                match self.nodes[slot].actors[core].get_mut(&entity) {
                    Some(a) if !a.stop_queued => {
                        self.stats.stops += 1;
                        a.stop_queued = true;
                        a.mailbox.push_back(Item::Stop(shard));
                        self.kick(slot, core, &entity);
                    }
                    _ => self.violate(
                        "single incarnation",
                        format!("stop for entity {entity} that is not running on {slot}/{core}"),
                    ),
                }
            }
            DataOutput::Persist { event, .. } => match event {
                ShardEvent::EntityStarted { shard, entity } => {
                    self.remembered.entry(shard).or_default().insert(entity);
                }
                ShardEvent::EntityStopped { shard, entity } => {
                    self.remembered.entry(shard).or_default().remove(&entity);
                }
            },
            DataOutput::RecoverRememberedEntities { ty, shard } => {
                let ids: Vec<EntityId> = self
                    .remembered
                    .get(&shard)
                    .map(|s| s.iter().cloned().collect())
                    .unwrap_or_default();
                let now = self.now;
                self.nodes[slot].data[core].handle_remembered_entities(now, ty, shard, ids);
            }
            // The world's entities arm no timers and its type is not a
            // stateless worker.
            DataOutput::TimerFired { .. } | DataOutput::ToWorker { .. } => self.violate(
                "harness",
                format!("core {slot}/{core}: an output for a timer or a worker"),
            ),
        }
    }

    /// A region's or a core's report for the node's control plane.
    fn data_to_control(&mut self, slot: usize, core: usize, m: ToControl) {
        let now = self.now;
        match m {
            ToControl::ToCoordinator { msg, .. } => self.plane_to_coordinator(slot, msg),
            ToControl::ToRegion { to, msg, .. } => self.plane_to_region(slot, to, msg),
            ToControl::Registered { core: c, all, warm } => {
                if let Some(p) = self.nodes[slot].plane.as_mut() {
                    p.handle_registered(now, c, all, warm);
                    self.drive_plane(slot);
                }
            }
            ToControl::ShutdownComplete { core: c } => {
                if let Some(d) = self.nodes[slot].handed_off.get_mut(usize::from(c)) {
                    *d = true;
                }
                self.log(|| format!("region {slot}/{core} handed off every shard"));
                if let Some(p) = self.nodes[slot].plane.as_mut() {
                    p.handle_shutdown_complete(now, c);
                    self.drive_plane(slot);
                }
            }
            _ => self.violate(
                "harness",
                format!("core {slot}/{core}: an unexpected message for the control plane"),
            ),
        }
    }

    /// Answers a message's sender.
    pub(super) fn reply(
        &mut self,
        slot: usize,
        core: usize,
        to: ReplyTo,
        status: Status,
        payload: Vec<u8>,
    ) {
        match to {
            ReplyTo::Client { request_id, .. } => self.client_answer(request_id, status),
            ReplyTo::Remote { conn, tag } => {
                let Some(&(os, ouid, ocore)) = self.inbound.get(&conn) else {
                    return self.violate("harness", format!("a reply to unknown lane {conn}"));
                };
                let frame = DataFrame::Reply {
                    tag,
                    status: status as u8,
                    payload,
                };
                let mut buf = Vec::new();
                if let Err(e) = encode_frame(&frame, &mut buf) {
                    return self.violate("codec", format!("a reply does not encode: {e}"));
                }
                let bytes = buf[FRAME_HEADER_BYTES..].to_vec();
                self.send(slot, os, ouid, Body::LaneReply { core: ocore, bytes });
            }
            ReplyTo::Core { core: c, token } => {
                let uid = self.nodes[slot].uid;
                let body = Body::CoreReply {
                    core: usize::from(c),
                    token,
                    status,
                    payload,
                };
                self.send(slot, slot, uid, body);
            }
            other => self.violate(
                "harness",
                format!("core {slot}/{core}: an answer to {other:?}, which the world never sends"),
            ),
        }
    }

    /// A simulated client's answer for message `id`.
    fn client_answer(&mut self, id: u64, status: Status) {
        let Some(r) = self.ledger.get_mut(id as usize) else {
            return self.violate("harness", format!("an answer for unknown message {id}"));
        };
        if r.answered {
            return self.violate(
                "one answer",
                format!("message {id} answered twice (the second {status:?})"),
            );
        }
        r.answered = true;
        match (status, r.outcome) {
            (Status::Ok, Outcome::Delivered | Outcome::InDoubt(_)) => {}
            (Status::Ok, o) => {
                let d = format!("message {id} answered Ok, but it is {o:?}");
                self.violate("exactly once", d)
            }
            (Status::TimedOut, Outcome::Pending) => {
                r.outcome = Outcome::InDoubt("timed out");
                self.stats.timed_out += 1;
            }
            (Status::TimedOut, _) => self.stats.timed_out += 1,
            (s, Outcome::Pending | Outcome::InDoubt(_)) => {
                r.outcome = Outcome::Failed(status_name(s));
                r.loc = Loc::Done;
                if s == Status::BufferFull {
                    self.stats.buffer_full += 1;
                }
            }
            (s, o) => {
                let d = format!("message {id} is {o:?}, but its sender was told {s:?}");
                self.violate("exactly once", d)
            }
        }
    }

    /// Opens a data lane from core `core` of `slot` to region `to`: it
    /// connects when the member runs, else fails to connect after a
    /// network latency.
    fn open_lane(&mut self, slot: usize, core: usize, to: RegionId) {
        self.next_lane += 1;
        let lane = Lane {
            generation: self.next_lane,
            conn: self.next_lane,
        };
        let uid = self.nodes[slot].uid;
        self.lanes.insert((slot, core, to.clone()), lane);
        self.inbound.insert(lane.conn, (slot, uid, core));
        let runs = self
            .slot_of
            .get(&to.member.address)
            .is_some_and(|&s| self.nodes[s].alive && self.nodes[s].uid == to.member.uid);
        self.log(|| {
            format!(
                "core {slot}/{core} opens lane {} to {to} (runs: {runs})",
                lane.conn
            )
        });
        if !runs {
            let d = Duration::from_micros(self.rng.gen_range(500..=20_000));
            self.schedule(
                self.now + d,
                Ev::LaneClosed {
                    slot,
                    uid,
                    core,
                    to,
                    generation: lane.generation,
                    connected: false,
                },
            );
        }
    }

    /// Writes a frame on the lane the plane opened for it.
    fn transmit_data(&mut self, slot: usize, core: usize, t: Transmit) {
        let Some(lane) = self.lanes.get(&(slot, core, t.to.clone())).copied() else {
            return self.nodes[slot].data[core].handle_transmit_refused(
                t,
                Status::Unavailable,
                b"no lane".to_vec(),
            );
        };
        let Some(&ts) = self.slot_of.get(&t.to.member.address) else {
            return self.violate("harness", format!("a lane to unknown region {}", t.to));
        };
        let msg = match &t.frame {
            DataFrame::Forward { payload, .. } => msg_id(payload),
            _ => None,
        };
        let mut buf = Vec::new();
        if let Err(e) = encode_frame(&t.frame, &mut buf) {
            return self.violate("codec", format!("a forward does not encode: {e}"));
        }
        if let Some(id) = msg {
            self.ledger[id as usize].loc = Loc::Link(slot, ts);
        }
        let body = Body::Data {
            core: usize::from(t.to.core),
            conn: lane.conn,
            msg,
            bytes: buf[FRAME_HEADER_BYTES..].to_vec(),
        };
        self.send(slot, ts, t.to.member.uid, body);
    }

    /// A lane of core `core` of `slot` closed.
    pub(super) fn lane_closed(
        &mut self,
        slot: usize,
        uid: MemberUid,
        core: usize,
        to: RegionId,
        generation: u64,
        connected: bool,
    ) {
        let n = &self.nodes[slot];
        if !n.alive || n.uid != uid {
            return;
        }
        let key = (slot, core, to.clone());
        let current = self
            .lanes
            .get(&key)
            .is_some_and(|l| l.generation == generation);
        if current {
            self.lanes.remove(&key);
        }
        self.log(|| format!("core {slot}/{core}: lane to {to} closed (connected {connected}, current {current})"));
        let now = self.now;
        self.nodes[slot].data[core].handle_link_closed(now, &to, connected, current);
        self.drive_core(slot, core);
    }

    /// `slot` crashed or stopped: the lanes of the other nodes to it break
    /// after a network latency; its own lanes are gone.
    pub(super) fn break_lanes_of(&mut self, slot: usize) {
        let me = self.nodes[slot].member();
        let mut broken: Vec<(usize, usize, RegionId, u64)> = self
            .lanes
            .iter()
            .filter(|((s, _, to), _)| *s != slot && to.member == me)
            .map(|((s, c, to), l)| (*s, *c, to.clone(), l.generation))
            .collect();
        broken.sort();
        for (s, c, to, generation) in broken {
            let d = Duration::from_micros(self.rng.gen_range(500..=20_000));
            let uid = self.nodes[s].uid;
            self.schedule(
                self.now + d,
                Ev::LaneClosed {
                    slot: s,
                    uid,
                    core: c,
                    to,
                    generation,
                    connected: true,
                },
            );
        }
        self.lanes.retain(|(s, _, _), _| *s != slot);
    }

    /// A packet of the data path reached core `core` of `slot`.
    pub(super) fn data_arrive(&mut self, slot: usize, body: Body) {
        let now = self.now;
        match body {
            Body::Data {
                core,
                conn,
                msg,
                bytes,
            } => {
                if core >= self.nodes[slot].data.len() {
                    return self.violate("harness", format!("a frame for core {slot}/{core}"));
                }
                self.check_may_act(slot, "handled a user message");
                if let Some(id) = msg {
                    self.ledger[id as usize].loc = Loc::Region(slot);
                }
                if let Err(e) = self.nodes[slot].data[core].handle_data_frame(
                    now,
                    conn,
                    &bytes::Bytes::from(bytes),
                ) {
                    return self.violate("codec", format!("a data frame to {slot}/{core}: {e}"));
                }
                self.drive_core(slot, core);
            }
            Body::LaneReply { core, bytes } => {
                if let Err(e) = self.nodes[slot].data[core].handle_link_frame(&bytes, Vec::new()) {
                    return self.violate("codec", format!("a reply frame to {slot}/{core}: {e}"));
                }
                self.drive_core(slot, core);
            }
            Body::ToCore {
                core,
                type_name,
                envelope,
            } => {
                self.check_may_act(slot, "handled a user message");
                if let Some(id) = msg_id(&envelope.payload) {
                    self.ledger[id as usize].loc = Loc::Region(slot);
                }
                self.nodes[slot].data[core].handle_message(now, &type_name, envelope);
                self.drive_core(slot, core);
            }
            Body::CoreReply {
                core,
                token,
                status,
                payload,
            } => {
                self.nodes[slot].data[core].handle_local_reply(token, status, payload);
                self.drive_core(slot, core);
            }
            Body::Frame(_) => unreachable!("control frames go to the control plane"),
        }
    }

    /// A simulated client on core `core` of `slot` sends message `id`.
    pub(super) fn client_send(
        &mut self,
        slot: usize,
        core: usize,
        sender: u32,
        id: u64,
        entity: EntityId,
    ) {
        let env = UserEnvelope {
            deadline: None,
            shard: shard_id_of(entity.as_str(), self.cfg.shards),
            entity,
            sender: ReplyTo::Client {
                conn: u64::from(sender),
                request_id: id,
            },
            payload: bytes::Bytes::copy_from_slice(&id.to_le_bytes()),
        };
        let now = self.now;
        self.nodes[slot].data[core].handle_message(now, TYPE, env);
        self.drive_core(slot, core);
    }

    /// The node stopped (left, downed): every core answers what its
    /// regions buffered `ShuttingDown`, then what it forwarded without an
    /// answer yet `TimedOut` (the stop drain), as the node's data
    /// executor does.
    pub(super) fn stop_cores(&mut self, slot: usize) {
        for core in 0..self.nodes[slot].data.len() {
            self.nodes[slot].data[core].handle_stop();
            self.drive_core(slot, core);
            self.nodes[slot].data[core].handle_drain_end();
            self.drive_core(slot, core);
        }
    }

    /// Entity `entity` of core `core` asked to passivate.
    pub(super) fn passivate(
        &mut self,
        slot: usize,
        core: usize,
        shard: ShardId,
        entity: &EntityId,
    ) {
        let now = self.now;
        self.nodes[slot].data[core].handle_passivate(now, TY, shard, entity);
        self.drive_core(slot, core);
    }

    /// Entity `entity` of core `core` stopped.
    pub(super) fn entity_stopped(
        &mut self,
        slot: usize,
        core: usize,
        shard: ShardId,
        entity: &EntityId,
    ) {
        let now = self.now;
        self.nodes[slot].data[core].handle_entity_stopped(now, TY, shard, entity);
        self.drive_core(slot, core);
    }
}

fn status_name(s: Status) -> &'static str {
    match s {
        Status::BufferFull => "buffer full",
        Status::ShuttingDown => "shutting down",
        Status::Unavailable => "unavailable",
        _ => "other",
    }
}

/// One line for the trace: the output's kind and what it is about.
fn describe(o: &DataOutput) -> String {
    match o {
        DataOutput::Reply { to, status, .. } => format!("reply {status:?} to {to:?}"),
        DataOutput::ToControl(m) => match m {
            ToControl::ToCoordinator { msg, .. } => format!("to the coordinator: {msg:?}"),
            ToControl::ToRegion { to, msg, .. } => format!("to region {to}: {msg:?}"),
            ToControl::Registered { core, all, warm } => {
                format!("core {core} registered: {all}, warm: {warm}")
            }
            ToControl::ShutdownComplete { core } => format!("core {core} handed off"),
            _ => "to the control plane".to_string(),
        },
        DataOutput::OpenLink { to } => format!("open lane to {to}"),
        DataOutput::CloseLink { to } => format!("close lane to {to}"),
        DataOutput::Transmit(t) => match &t.frame {
            DataFrame::Forward {
                tag,
                entity_id,
                payload,
                ..
            } => format!(
                "forward {:?} to {entity_id} at {} (tag {tag})",
                msg_id(payload),
                t.to
            ),
            f => format!("frame to {}: {f:?}", t.to),
        },
        DataOutput::ToCore { core, envelope, .. } => format!(
            "to core {core}: {:?} for {} from {:?}",
            msg_id(&envelope.payload),
            envelope.entity,
            envelope.sender
        ),
        DataOutput::Deliver { envelope, .. } => format!(
            "deliver {:?} to {} from {:?}",
            msg_id(&envelope.payload),
            envelope.entity,
            envelope.sender
        ),
        DataOutput::ToWorker { .. } => "to a worker".to_string(),
        DataOutput::StartEntity { shard, entity, .. } => format!("start {entity} of {shard}"),
        DataOutput::StopEntity {
            shard,
            entity,
            reason,
            ..
        } => format!("stop {entity} of {shard} ({reason:?})"),
        DataOutput::TimerFired { entity, key, .. } => format!("timer {key} of {entity}"),
        DataOutput::Persist { event, .. } => format!("persist {event:?}"),
        DataOutput::RecoverRememberedEntities { shard, .. } => {
            format!("recover the remembered entities of {shard}")
        }
    }
}
