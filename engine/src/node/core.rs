//! A data executor: the driver of one core's data plane
//! ([`DataPlane`], `node/plane/data.rs`, which owns the regions and makes
//! the routing decisions), the entities it hosts, the data lanes to other
//! nodes, and the fronts (`crate::gateway`) it starts and serves through
//! [`DataPort`] (implemented here for [`DataExecutorRef`]), answering them
//! through their reply sink ([`Fronts::reply`]).
//!
//! Everything here runs on one thread; the state is one
//! `Rc<RefCell<DataExecutor>>` borrowed for the length of one input (a
//! frame, a ring message, a tick), never across an await. Each input is
//! fed to the plane, then the plane's outputs are carried out
//! ([`DataExecutor::run_effects`]); entities run to completion inside that
//! borrow.

use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap};
use std::os::fd::FromRawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use monoio::io::Splitable;
use shardline_core::ids::{Address, EntityId, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{shard_id_of, Envelope};

use super::msg::{ReplyTo, ToControl, ToCore, UserEnvelope};
use super::plane::data::{DataOutput, DataPlane, DataPlaneConfig, Transmit, TypeIdx};
use super::watch::{EntityKey, SystemMsg, WatchBook};
use super::{RegionStatusView, Shared};
use crate::config::NodeConfig;
use crate::entity::{Entity, EntityContext, EntityFactory, TerminatedReason};
use crate::envelope::{encode_frame, FrameError, Status, MAX_FRAME_SIZE_BYTES};
use crate::envelope::{DataFrame, Lane};
use crate::gateway::port::{ConnId, DataPort};
use crate::gateway::{Fronts, MetricsBoard};
use crate::runtime::{RingReceiver, RingSender};
use crate::transport::{self, FrameReader, Outbox, OUTBOX_HIGH_WATER_BYTES};

mod workers;

/// Everything a data executor starts with.
pub(crate) struct DataExecutorInit {
    pub index: u16,
    pub config: NodeConfig,
    pub uid: MemberUid,
    pub epoch: Instant,
    pub inbox: RingReceiver<ToCore>,
    pub to_control: RingSender<ToControl>,
    pub to_cores: Vec<RingSender<ToCore>>,
    pub shared: Arc<Shared>,
    pub scope: Arc<crate::persistence::DataScope>,
    /// The node's board of the fronts' counters (`/metrics`).
    pub metrics_board: Arc<MetricsBoard>,
}

/// Tick period of the executor's timers.
const TICK: Duration = Duration::from_millis(5);
/// After the node stops (it left, or was downed), how long its connections
/// stay open: requests still arriving (pipelined, or already in socket
/// buffers) are answered `ShuttingDown`, and forwarded messages get their
/// replies; then every connection is closed after its answers are written.
const STOP_DRAIN: Duration = Duration::from_millis(1000);
/// Most time an exiting executor waits for its connections' writers.
const EXIT_WRITE_WAIT: Duration = Duration::from_secs(2);

/// A hash map with foldhash's per-process random seed: fast, and not
/// predictable by a client choosing entity ids.
type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The hosted entity types of one core: a few entries, found by a linear
/// scan (cheaper than hashing the name on every message).
#[derive(Default)]
struct TypeTable {
    /// In the order of the plane's [`TypeIdx`].
    entries: Vec<(Rc<str>, TypeHost)>,
}

impl TypeTable {
    fn get(&self, t: &str) -> Option<&TypeHost> {
        self.entries.iter().find(|(n, _)| &**n == t).map(|(_, h)| h)
    }
    fn get_mut(&mut self, t: &str) -> Option<&mut TypeHost> {
        self.entries
            .iter_mut()
            .find(|(n, _)| &**n == t)
            .map(|(_, h)| h)
    }
    fn insert(&mut self, t: &str, h: TypeHost) {
        self.entries.push((Rc::from(t), h));
    }
    fn keys(&self) -> impl Iterator<Item = &Rc<str>> + '_ {
        self.entries.iter().map(|(n, _)| n)
    }
    /// The name of type `ty` (a reference count, not a copy).
    fn name(&self, ty: TypeIdx) -> Rc<str> {
        self.entries[ty.0].0.clone()
    }
}

struct TypeHost {
    factory: Option<EntityFactory>,
    entities: FastMap<EntityId, Live>,
    delivered: u64,
    activated: u64,
    /// `Some` for a stateless worker type: its requests bypass the region.
    worker: Option<workers::WorkerHost>,
}

struct Live {
    entity: Box<dyn Entity>,
    shard: ShardId,
    incarnation: u64,
    /// The shard's allocation generation when the entity started (the
    /// writer epoch of its journal appends).
    epoch: u64,
}

struct Link {
    outbox: Rc<Outbox>,
}

/// An incarnation being stopped whose journal appends have no outcome yet
/// ([`Entity::on_stopping`]): it gets no message, only
/// [`Entity::on_durable`], until they do; then it stops.
struct Stopping {
    type_name: String,
    id: EntityId,
    live: Live,
    reason: TerminatedReason,
    /// Tell the region when it stopped (false when the whole node stops).
    tell_region: bool,
}

/// A read of a shard's remembered entities in flight, or waiting to be
/// retried after a failure (the shard waits in `Recovering`, its messages
/// buffered in the region).
struct RememberPending {
    type_name: String,
    shard: ShardId,
    /// The shard's allocation generation when the read started.
    generation: u64,
    /// The read in flight (`None`: retry at `retry_at`).
    ticket: Option<u64>,
    retry_at: Duration,
    /// Failed reads in a row (count).
    failures: u32,
}

/// First and largest delay before a failed read of remembered entities is
/// retried.
const REMEMBER_RETRY_MIN: Duration = Duration::from_millis(100);
const REMEMBER_RETRY_MAX: Duration = Duration::from_secs(2);

pub(crate) struct DataExecutor {
    index: u16,
    me: UniqueAddress,
    epoch: Instant,
    config: NodeConfig,
    types: TypeTable,
    /// Every connection of this executor (the fronts' and inbound data
    /// lanes'), closed when the stop drain ends.
    conns: FastMap<u64, Rc<Outbox>>,
    /// The fronts of this executor: the reply sink of client requests.
    fronts: Fronts,
    /// This executor's own handle, for the tasks it spawns (data lanes).
    self_ref: std::rc::Weak<RefCell<DataExecutor>>,
    next_conn: u64,
    /// The routing decisions: regions, forwarding bookkeeping, lanes.
    plane: DataPlane,
    /// The data lanes the plane opened, by remote region.
    links: HashMap<RegionId, Link>,
    /// Ids of API asks and of entities' reply tokens.
    next_tag: u64,
    api_waiters: FastMap<u64, crate::api::oneshot::Sender<super::msg::ApiAnswer>>,
    /// When the core stops waiting for an API ask's answer: (due, id).
    api_expiry: BinaryHeap<std::cmp::Reverse<(Duration, u64)>>,
    /// Asks of this core's entities waiting for their answer, by ask id.
    entity_asks: FastMap<u64, EntityAskWait>,
    /// When an entity's ask times out: (due, ask id).
    entity_ask_expiry: BinaryHeap<std::cmp::Reverse<(Duration, u64)>>,
    to_control: RingSender<ToControl>,
    to_cores: Vec<RingSender<ToCore>>,
    next_incarnation: u64,
    available: bool,
    shutdown: bool,
    /// [`ToCore::Shutdown`] arrived: exit once the stop drain is over.
    exit_requested: bool,
    /// When the stop drain ends (set when the node stops).
    drain_until: Option<Duration>,
    /// The stop drain is over: connections closed.
    drained: bool,
    /// Deferred replies and entities awaiting journal durability.
    durable: crate::persistence::Hooks,
    /// Lifecycle watches of this core's entities (`node::watch`).
    watches: WatchBook,
    /// Set while [`DataExecutor::flush_system`] routes (no re-entry).
    flushing_system: bool,
    /// Why this core's journal could not be opened (durable entities then
    /// fail and `/health/ready` answers 503).
    journal_error: Option<String>,
    /// Incarnations stopping after their appends in flight, by incarnation.
    stopping: FastMap<u64, Stopping>,
    /// Reads of remembered entities in flight or waiting for a retry.
    remember_reads: Vec<RememberPending>,
    /// Why the last read of remembered entities failed, while a shard
    /// waits for its retry.
    remember_error: Option<String>,
    /// The node's data scope (cluster id for the data lanes' hellos).
    scope: Arc<crate::persistence::DataScope>,
    /// What this node's hellos carry.
    fp: crate::transport::Fingerprint,
}

pub(crate) type DataExecutorRef = Rc<RefCell<DataExecutor>>;

/// An ask of an entity of this core waiting for its answer.
struct EntityAskWait {
    type_name: String,
    entity: EntityId,
    incarnation: u64,
    /// When the ask times out (core clock): an answer that comes later
    /// (e.g. handled on this core while the timeout's tick could not run)
    /// is turned into `TimedOut`, as the asker was promised.
    due: Duration,
}

/// Runs a data executor until [`ToCore::Shutdown`].
pub(crate) async fn run(init: DataExecutorInit) {
    let me = UniqueAddress {
        address: Address(init.config.cluster_address.to_string()),
        uid: init.uid,
    };
    let listener = match transport::listener(init.config.client_address, true) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(core = init.index, error = %e, "cannot bind client address");
            return;
        }
    };
    let answer_timeout =
        init.config.requests.ask_timeout() + Duration::from_millis(crate::config::ANSWER_GRACE_MS);
    let fronts = Fronts::new(init.index, init.metrics_board, answer_timeout);
    let http_front = crate::gateway::http::serve::bind(&init.config, init.index, &fronts);
    let fp = super::fingerprint(&init.config, &init.scope);
    let plane = DataPlane::new(DataPlaneConfig::from_node_config(
        &init.config,
        me.clone(),
        init.index,
    ));
    let core = Rc::new_cyclic(|self_ref| {
        RefCell::new(DataExecutor {
            plane,
            self_ref: self_ref.clone(),
            fronts: fronts.clone(),
            scope: init.scope,
            fp,
            index: init.index,
            me,
            epoch: init.epoch,
            config: init.config,
            types: TypeTable::default(),
            conns: FastMap::default(),
            next_conn: 1,
            links: HashMap::new(),
            next_tag: 1,
            api_waiters: FastMap::default(),
            api_expiry: BinaryHeap::new(),
            entity_asks: FastMap::default(),
            entity_ask_expiry: BinaryHeap::new(),
            to_control: init.to_control,
            to_cores: init.to_cores,
            next_incarnation: 1,
            available: false,
            shutdown: false,
            exit_requested: false,
            drain_until: None,
            drained: false,
            durable: crate::persistence::Hooks::default(),
            watches: WatchBook::default(),
            flushing_system: false,
            journal_error: None,
            stopping: FastMap::default(),
            remember_reads: Vec::new(),
            remember_error: None,
        })
    });
    drop(init.shared);
    {
        let mut c = core.borrow_mut();
        if let Some(pg) = crate::persistence::pg::PgSettings::from_config(&c.config.journal) {
            // Each turn's appends go to the core's writer thread in one
            // batch: this task runs after the turn's other ready tasks.
            let flush = Arc::new(crate::persistence::DurableWake::default());
            crate::persistence::open_postgres_for_core(&pg, c.index, &c.durable.wake, &flush);
            let flush_core = core.clone();
            monoio::spawn(async move {
                loop {
                    flush.wait().await;
                    let _ = crate::persistence::with_log(|l| l.flush());
                    if flush_core.borrow().shutdown {
                        return;
                    }
                }
            });
        } else if let Err(e) = crate::persistence::open_for_core(
            &c.config.data_dir,
            c.index,
            &c.config.durability,
            Some(c.scope.clone()),
        ) {
            tracing::error!(core = c.index, error = %e, "cannot open the core's journal; durable entities fail");
            c.journal_error = Some(e.to_string());
        }
    }
    let durable_core = core.clone();
    let wake = core.borrow().durable.wake.clone();
    monoio::spawn(async move {
        loop {
            wake.wait().await;
            if durable_core.borrow().shutdown {
                return;
            }
            durable_core.borrow_mut().on_durable_advance();
        }
    });
    let accept_core = core.clone();
    let stop_accept = crate::runtime::LocalNotify::default();
    let stop = stop_accept.clone();
    let accept = monoio::spawn(async move {
        while let Some(r) = crate::runtime::accept_or_stop(&listener, &stop).await {
            match r {
                Ok((stream, _)) => {
                    transport::tune(&stream);
                    monoio::spawn(crate::gateway::native::serve_client(
                        accept_core.clone(),
                        fronts.clone(),
                        stream,
                    ));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    monoio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            if accept_core.borrow().shutdown {
                break;
            }
        }
        drop(listener);
    });
    let http_accept = crate::gateway::http::serve::start(&core, http_front);
    let tick_core = core.clone();
    monoio::spawn(async move {
        loop {
            monoio::time::sleep(TICK).await;
            if tick_core.borrow().shutdown {
                return;
            }
            tick_core.borrow_mut().tick();
        }
    });
    let mut inbox = init.inbox;
    let mut batch = Vec::with_capacity(256);
    loop {
        let exiting = core.borrow().exit_requested;
        if exiting {
            // Draining: keep taking replies from the other cores while the
            // connections answer what they still read.
            if core.borrow().drained {
                break;
            }
            match monoio::time::timeout(TICK, inbox.recv_batch(&mut batch, 256)).await {
                Ok(true) | Err(_) => {}
                Ok(false) => monoio::time::sleep(TICK).await,
            }
        } else if !inbox.recv_batch(&mut batch, 256).await {
            break;
        }
        for m in batch.drain(..) {
            if matches!(m, ToCore::Shutdown) {
                let mut c = core.borrow_mut();
                // A node that exits without a completed leave stops here:
                // its buffers are answered, not dropped.
                c.stop_node();
                c.exit_requested = true;
            } else {
                DataExecutor::on_inbox(&core, m);
            }
        }
    }
    let outboxes: Vec<Rc<Outbox>> = {
        let mut c = core.borrow_mut();
        c.finish_drain();
        c.shutdown = true;
        let mut v: Vec<Rc<Outbox>> = c.conns.values().cloned().collect();
        v.extend(c.links.values().map(|l| l.outbox.clone()));
        v
    };
    // Connections close after their answers are written (bounded).
    let until = Instant::now() + EXIT_WRITE_WAIT;
    while Instant::now() < until && outboxes.iter().any(|o| !o.finished.get()) {
        monoio::time::sleep(TICK).await;
    }
    crate::runtime::stop_accepting(&stop_accept, accept).await;
    if let Some((stop, task)) = http_accept {
        crate::runtime::stop_accepting(&stop, task).await;
    }
    if let Some(log) = crate::persistence::uninstall() {
        drop(log); // syncs and closes the core's journal
    }
}

impl DataExecutor {
    pub(crate) fn now(&self) -> Duration {
        self.epoch.elapsed()
    }

    // ----- connections -----

    pub(crate) fn add_conn(&mut self, outbox: Rc<Outbox>) -> u64 {
        let id = self.next_conn;
        self.next_conn += 1;
        self.conns.insert(id, outbox);
        id
    }

    pub(crate) fn remove_conn(&mut self, id: u64) {
        if let Some(o) = self.conns.remove(&id) {
            o.close();
        }
    }

    /// Answers a front's request through the fronts' reply sink (dropped
    /// when its connection is gone).
    fn send_client(&mut self, conn: ConnId, request_id: u64, status: Status, payload: Vec<u8>) {
        self.fronts.reply(conn, request_id, status, payload);
    }

    fn reply(&mut self, to: ReplyTo, status: Status, payload: Vec<u8>) {
        match to {
            ReplyTo::Nobody => {}
            ReplyTo::Client { conn, request_id } => {
                self.send_client(conn, request_id, status, payload)
            }
            ReplyTo::Remote { conn, tag } => {
                if let Some(o) = self.conns.get(&conn) {
                    let f = DataFrame::Reply {
                        tag,
                        status: status as u8,
                        payload,
                    };
                    let _ = encode_frame(&f, &mut o.buf.borrow_mut());
                    o.flush();
                }
            }
            ReplyTo::Core { core, token } => {
                if let Some(tx) = self.to_cores.get(usize::from(core)) {
                    if tx
                        .send(ToCore::LocalReply {
                            token,
                            status,
                            payload,
                        })
                        .is_err()
                    {
                        tracing::warn!(core, "reply to another core lost: ring full or closed");
                    }
                }
            }
            ReplyTo::Api { id } => {
                if let Some(tx) = self.api_waiters.remove(&id) {
                    // The asker may have dropped its future: the answer
                    // is dropped with it.
                    let _ = tx.send(Some((status, payload)));
                }
            }
            ReplyTo::EntityAsk { id } => {
                if !self.entity_asks.contains_key(&id) {
                    return; // timed out or its asker stopped
                }
                let own = self.to_cores.get(usize::from(self.index));
                if own.is_none_or(|tx| {
                    tx.send(ToCore::AskReply {
                        id,
                        status,
                        payload,
                    })
                    .is_err()
                }) {
                    tracing::warn!(
                        core = self.index,
                        "answer to an entity's ask dropped: inbox full (the ask times out)"
                    );
                }
            }
            ReplyTo::System(m) => {
                if status != Status::Ok {
                    tracing::debug!(?status, "system message undeliverable");
                    self.watches.undeliverable(*m);
                }
            }
        }
    }

    // ----- client requests -----

    /// Routes one entity request of a front (see
    /// [`DataPort::client_request`]).
    pub(crate) fn client_request(
        &mut self,
        conn: u64,
        request_id: u64,
        type_name: &[u8],
        entity_id: &[u8],
        payload: Vec<u8>,
    ) {
        let now = self.now();
        self.plane
            .handle_client_request(now, conn, request_id, type_name, entity_id, payload);
        self.run_effects();
    }

    /// Hands a user message to this core's region of `t` and runs the effects
    /// (a stateless worker type's message runs on its pool).
    fn route(&mut self, t: &str, env: UserEnvelope) {
        let now = self.now();
        self.plane.handle_message(now, t, env);
        self.run_effects();
    }

    // ----- data lanes -----

    /// A frame on an inbound data lane. `Err` closes the connection.
    pub(crate) fn on_data_frame(&mut self, conn: u64, body: &[u8]) -> Result<(), FrameError> {
        let now = self.now();
        let r = self.plane.handle_data_frame(now, conn, body);
        self.run_effects();
        r
    }

    /// A reply on an outbound data lane.
    pub(crate) fn on_link_frame(&mut self, body: &[u8]) -> Result<(), FrameError> {
        let r = self.plane.handle_link_frame(body);
        self.run_effects();
        r
    }

    /// The data lane to `to` closed (`connected`: its handshake had
    /// completed); the plane answers what waited on it.
    fn link_failed(&mut self, to: &RegionId, outbox: &Rc<Outbox>, connected: bool) {
        let current = self
            .links
            .get(to)
            .is_some_and(|l| Rc::ptr_eq(&l.outbox, outbox));
        if current {
            self.links.remove(to);
        }
        let now = self.now();
        self.plane.handle_link_closed(now, to, connected, current);
        self.run_effects();
    }

    /// Writes a frame on the data lane the plane opened for it; a lane
    /// over its high-water mark or a frame that does not encode is handed
    /// back to the plane, which answers the sender.
    fn transmit(&mut self, t: Transmit) {
        let Some(link) = self.links.get(&t.to) else {
            return self
                .plane
                .handle_transmit_refused(t, Status::Unavailable, b"no link".to_vec());
        };
        let outbox = link.outbox.clone();
        if outbox.buf.borrow().len() > OUTBOX_HIGH_WATER_BYTES {
            return self.plane.handle_transmit_refused(
                t,
                Status::BufferFull,
                b"link to the home node is full".to_vec(),
            );
        }
        let encoded = encode_frame(&t.frame, &mut outbox.buf.borrow_mut());
        if let Err(e) = encoded {
            // The fronts refuse messages over the limit; this is a message
            // from an entity or the embedding API.
            let status = match t.frame {
                DataFrame::System { .. } => Status::BufferFull,
                _ => Status::TooLarge,
            };
            return self
                .plane
                .handle_transmit_refused(t, status, e.to_string().into_bytes());
        }
        outbox.flush();
    }

    // ----- effects -----

    /// Carries out the plane's outputs until it has none (the entities'
    /// deliveries may feed it more), then routes the watch book's system
    /// messages.
    fn run_effects(&mut self) {
        loop {
            let now = self.now();
            let Some(o) = self.plane.poll_output(now) else {
                break;
            };
            match o {
                DataOutput::Reply {
                    to,
                    status,
                    payload,
                } => self.reply(to, status, payload),
                DataOutput::ToControl(m) => {
                    let _ = self.to_control.send(m);
                }
                DataOutput::OpenLink { to } => {
                    let Some(core_rc) = self.self_ref.upgrade() else {
                        continue;
                    };
                    let outbox = Rc::new(Outbox::default());
                    self.links.insert(
                        to.clone(),
                        Link {
                            outbox: outbox.clone(),
                        },
                    );
                    monoio::spawn(run_link(core_rc, to, outbox));
                }
                DataOutput::CloseLink { to } => {
                    if let Some(l) = self.links.remove(&to) {
                        l.outbox.close();
                    }
                }
                DataOutput::Transmit(t) => self.transmit(t),
                DataOutput::ToCore {
                    core,
                    type_name,
                    envelope,
                } => {
                    let Some(tx) = self.to_cores.get(usize::from(core)) else {
                        self.plane.handle_core_refused(envelope);
                        continue;
                    };
                    if let Err(
                        crate::runtime::RingSendError::Full(m)
                        | crate::runtime::RingSendError::Closed(m),
                    ) = tx.send(ToCore::Forwarded {
                        type_name,
                        envelope,
                    }) {
                        if let ToCore::Forwarded { envelope, .. } = m {
                            self.plane.handle_core_refused(envelope);
                        }
                    }
                }
                DataOutput::Deliver { ty, envelope } => {
                    let t = self.types.name(ty);
                    self.deliver(&t, envelope);
                }
                DataOutput::ToWorker { ty, envelope } => {
                    let t = self.types.name(ty);
                    self.worker_route(&t, envelope);
                }
                DataOutput::StartEntity { ty, shard, entity } => {
                    let t = self.types.name(ty);
                    self.ensure_entity(&t, shard, &entity);
                }
                DataOutput::StopEntity {
                    ty,
                    shard,
                    entity,
                    stop_message,
                    reason,
                } => {
                    let t = self.types.name(ty);
                    if let Some(m) = stop_message {
                        let env = Envelope {
                            deadline: None,
                            entity: entity.clone(),
                            shard,
                            sender: ReplyTo::Nobody,
                            payload: m,
                        };
                        self.deliver(&t, env);
                    }
                    tracing::debug!(entity = %entity, ?reason, "stopping entity");
                    let live = self
                        .types
                        .get_mut(&t)
                        .and_then(|h| h.entities.remove(&entity));
                    match live {
                        Some(l) => {
                            let why = match reason {
                                shardline_core::sharding::StopReason::HandOff => {
                                    TerminatedReason::HandOff
                                }
                                _ => TerminatedReason::Stopped,
                            };
                            // The region learns that it stopped (and a
                            // hand-off's `ShardStopped` can go) only once
                            // its appends in flight have an outcome.
                            self.begin_stop(&t, entity, l, why, true);
                        }
                        None => self.plane.handle_entity_stopped(now, ty, shard, &entity),
                    }
                }
                DataOutput::Persist { ty, event } => {
                    crate::persistence::remember::record(
                        self.plane.type_name(ty),
                        self.plane.region(ty),
                        &event,
                    );
                }
                DataOutput::TimerFired {
                    ty,
                    entity,
                    key,
                    incarnation,
                } => {
                    let t = self.types.name(ty);
                    self.fire_timer(&t, &entity, key, incarnation);
                }
                DataOutput::RecoverRememberedEntities { ty, shard } => {
                    let t = self.types.name(ty);
                    self.start_remember_read(&t, shard, 0);
                }
            }
        }
        self.flush_system();
    }

    /// Entity `id` of `t` asked to passivate.
    fn passivate(&mut self, t: &str, shard: ShardId, id: &EntityId) {
        if let Some(ty) = self.plane.type_index(t) {
            let now = self.now();
            self.plane.handle_passivate(now, ty, shard, id);
        }
    }

    /// Entity `id` of `t` stopped: its region learns it.
    fn entity_stopped(&mut self, t: &str, shard: ShardId, id: &EntityId) {
        if let Some(ty) = self.plane.type_index(t) {
            let now = self.now();
            self.plane.handle_entity_stopped(now, ty, shard, id);
        }
    }

    // ----- lifecycle watches (node::watch) -----

    /// The incarnation of `id` stopped: tells its watchers, drops its watches.
    fn entity_gone(&mut self, t: &str, id: &EntityId, reason: TerminatedReason) {
        let key = EntityKey {
            type_name: t.to_string(),
            id: id.clone(),
        };
        self.watches.on_stopped(&key, reason);
    }

    /// Applies what a handler asked about watches.
    fn apply_watches(
        &mut self,
        t: &str,
        id: &EntityId,
        cmds: Vec<crate::entity::WatchCommand>,
        failed: bool,
    ) {
        if cmds.is_empty() && !failed {
            return;
        }
        let key = EntityKey {
            type_name: t.to_string(),
            id: id.clone(),
        };
        if failed {
            self.watches.mark_failed(&key);
        }
        self.watches.commands(&key, cmds);
    }

    /// A system message reached its entity's home region (delivered, or
    /// handed back because the entity is not active).
    fn deliver_system(&mut self, t: &str, entity: EntityId, msg: SystemMsg) {
        let active = self
            .types
            .get(t)
            .is_some_and(|h| h.entities.contains_key(&entity));
        let me = EntityKey {
            type_name: t.to_string(),
            id: entity,
        };
        match msg {
            SystemMsg::Watch { watcher, .. } => self.watches.on_watch(me, watcher, active),
            SystemMsg::Unwatch { watcher } => self.watches.on_unwatch(&me, &watcher),
            SystemMsg::Terminated { of, reason } => {
                if !active || !self.watches.take_watch(&me, &of) {
                    return;
                }
                let Some(h) = self.types.get_mut(t) else {
                    return;
                };
                let Some(live) = h.entities.get_mut(&me.id) else {
                    return;
                };
                let (inc, shard) = (live.incarnation, live.shard);
                let mut ctx = EntityContext::new(&me.id).with_type(t, live.epoch);
                live.entity
                    .on_terminated(&mut ctx, &of.type_name, &of.id, reason);
                let out = ctx.take_outgoing();
                let timers = ctx.take_timers();
                let passivate = ctx.wants_passivation();
                let wants_durable = ctx.wants_durable();
                let watches = ctx.take_watches();
                let failed = ctx.wants_failed_stop();
                drop(ctx);
                self.apply_timers(t, &me.id, inc, timers);
                if wants_durable {
                    self.durable.wait(t, &me.id, inc);
                }
                self.drain_completions();
                self.apply_watches(t, &me.id, watches, failed);
                self.send_outgoing(out, &mut None, None);
                if passivate {
                    self.passivate(t, shard, &me.id);
                }
            }
        }
    }

    /// Hands the answer of ask `id` of an entity of this core to the
    /// asker's [`crate::entity::Entity::on_ask_reply`], once, if the
    /// incarnation that asked still lives (else the answer is dropped).
    fn answer_entity_ask(
        &mut self,
        id: u64,
        reply: Result<Vec<u8>, crate::entity::EntityAskError>,
    ) {
        let Some(w) = self.entity_asks.remove(&id) else {
            return;
        };
        let reply = if reply.is_ok() && self.now() > w.due {
            Err(crate::entity::EntityAskError::TimedOut)
        } else {
            reply
        };
        let t = w.type_name;
        let Some(h) = self.types.get_mut(&t) else {
            return;
        };
        let Some(live) = h.entities.get_mut(&w.entity) else {
            return;
        };
        if live.incarnation != w.incarnation {
            return;
        }
        let (inc, shard) = (live.incarnation, live.shard);
        let mut ctx = EntityContext::new(&w.entity).with_type(&t, live.epoch);
        let res = live
            .entity
            .on_ask_reply(&mut ctx, crate::entity::AskId(id), reply);
        let out = ctx.take_outgoing();
        let timers = ctx.take_timers();
        let passivate = ctx.wants_passivation();
        let wants_durable = ctx.wants_durable();
        let watches = ctx.take_watches();
        let failed = ctx.wants_failed_stop();
        drop(ctx);
        self.apply_watches(&t, &w.entity, watches, failed);
        if let Err(e) = res {
            tracing::warn!(entity = %w.entity, error = %e, "entity failed on an ask's answer");
            if let Some(h) = self.types.get_mut(&t) {
                if let Some(mut l) = h.entities.remove(&w.entity) {
                    l.entity.on_stop();
                    self.entity_gone(&t, &w.entity, TerminatedReason::Failed);
                }
            }
            self.fail_deferred(inc);
            self.entity_stopped(&t, shard, &w.entity);
            self.run_effects();
            return;
        }
        self.apply_timers(&t, &w.entity, inc, timers);
        if wants_durable {
            self.durable.wait(&t, &w.entity, inc);
        }
        self.drain_completions();
        self.send_outgoing(out, &mut None, None);
        if passivate {
            self.passivate(&t, shard, &w.entity);
            self.run_effects();
        }
    }

    /// Routes the system messages the watch book queued, like user
    /// messages. Bounded per call; the rest waits for the next tick.
    fn flush_system(&mut self) {
        if self.flushing_system || !self.watches.has_outgoing() {
            return;
        }
        self.flushing_system = true;
        for _ in 0..16 {
            let out = self.watches.take_outgoing();
            if out.is_empty() {
                break;
            }
            for (to, msg) in out {
                let shard = shard_id_of(to.id.as_str(), self.config.number_of_shards);
                let env = Envelope {
                    deadline: None,
                    entity: to.id,
                    shard,
                    sender: ReplyTo::System(Box::new(msg)),
                    payload: Vec::new(),
                };
                self.route(&to.type_name, env);
            }
        }
        self.flushing_system = false;
    }

    /// Member `m` was removed: watchers here whose target's home (as this
    /// core's regions know it) was on `m` get `Terminated(NodeRemoved)`.
    fn watches_member_removed(&mut self, m: &UniqueAddress) {
        let plane = &self.plane;
        let n = self.config.number_of_shards;
        self.watches.on_member_removed(|k| {
            plane.type_index(&k.type_name).is_some_and(|ty| {
                plane
                    .region(ty)
                    .home_of(shard_id_of(k.id.as_str(), n))
                    .is_some_and(|(r, _)| r.member == *m)
            })
        });
    }

    /// Sends the deferred replies entities answered.
    fn drain_completions(&mut self) {
        for (token, status, payload) in crate::persistence::take_completions() {
            self.plane.handle_reply_durable(token, status, payload);
            self.release_replies();
            self.worker_completed(token);
        }
    }

    /// Sends the replies the plane's durability barrier released.
    fn release_replies(&mut self) {
        while let Some(r) = self.plane.poll_reply() {
            self.reply(r.to, r.status, r.payload);
        }
    }

    /// An incarnation stopped: answers its deferred replies (those it
    /// answered itself first), the rest with `EntityFailed`.
    fn fail_deferred(&mut self, inc: u64) {
        self.drain_completions();
        self.plane.handle_incarnation_stopped(inc);
        self.release_replies();
    }

    /// The journal's durable LSN advanced: entities with events in flight
    /// run their handlers and answer.
    fn on_durable_advance(&mut self) {
        crate::persistence::disarm_if_reached();
        let Ok(durable) = crate::persistence::with_log(|l| l.durable_lsn().0) else {
            return;
        };
        self.poll_remember_reads();
        for (t, id, inc) in self.durable.take_waiting() {
            if self.stopping.contains_key(&inc) {
                self.stopping_durable(inc, durable);
                continue;
            }
            let Some(h) = self.types.get_mut(&t) else {
                continue;
            };
            let Some(live) = h.entities.get_mut(&id) else {
                continue;
            };
            if live.incarnation != inc {
                continue;
            }
            let shard = live.shard;
            let mut ctx = EntityContext::new(&id).with_type(&t, live.epoch);
            let res = live.entity.on_durable(&mut ctx, durable);
            let timers = ctx.take_timers();
            let passivate = ctx.wants_passivation();
            let again = ctx.wants_durable();
            let watches = ctx.take_watches();
            let failed = ctx.wants_failed_stop();
            self.drain_completions();
            self.apply_watches(&t, &id, watches, failed);
            if let Err(e) = res {
                tracing::warn!(entity = %id, error = %e, "entity failed on a durable event");
                if let Some(h) = self.types.get_mut(&t) {
                    if let Some(mut l) = h.entities.remove(&id) {
                        l.entity.on_stop();
                        self.entity_gone(&t, &id, TerminatedReason::Failed);
                    }
                }
                self.fail_deferred(inc);
                self.entity_stopped(&t, shard, &id);
                self.run_effects();
                continue;
            }
            if !timers.is_empty() {
                self.apply_timers(&t, &id, inc, timers);
            }
            if again {
                self.durable.wait(&t, &id, inc);
            }
            if passivate {
                self.passivate(&t, shard, &id);
                self.run_effects();
            }
        }
    }

    // ----- stopping entities with appends in flight -----

    /// Stops incarnation `l` of `id`: at once, or (when it has journal
    /// appends without an outcome, [`Entity::on_stopping`]) once they have
    /// one: it is kept aside, gets [`Entity::on_durable`] as the journal's
    /// durable LSN moves (the journal's own notification wakes the core; no
    /// waiting on this thread), and stops then. Only then are its watchers
    /// told and, with `tell_region`, the region (so a hand-off's
    /// `ShardStopped` leaves after every stopped entity's events are
    /// durable).
    fn begin_stop(
        &mut self,
        t: &str,
        id: EntityId,
        mut l: Live,
        reason: TerminatedReason,
        tell_region: bool,
    ) {
        let keep = l.entity.on_stopping();
        self.drain_completions();
        let st = Stopping {
            type_name: t.to_string(),
            id,
            live: l,
            reason,
            tell_region,
        };
        if keep {
            let inc = st.live.incarnation;
            self.durable.wait(t, &st.id, inc);
            self.stopping.insert(inc, st);
        } else {
            self.end_stop(st);
        }
    }

    /// The last step of a stop: `on_stop`, the incarnation's deferred
    /// replies, its watchers, and (with `tell_region`) the region, whose
    /// effects the caller runs.
    fn end_stop(&mut self, mut st: Stopping) {
        st.live.entity.on_stop();
        let inc = st.live.incarnation;
        self.fail_deferred(inc);
        self.entity_gone(&st.type_name, &st.id, st.reason);
        if st.tell_region {
            self.entity_stopped(&st.type_name, st.live.shard, &st.id);
        }
    }

    /// The durable LSN moved while incarnation `inc` is stopping: its
    /// handlers run and answer; it stops once nothing is in flight.
    fn stopping_durable(&mut self, inc: u64, durable: u64) {
        let Some(st) = self.stopping.get_mut(&inc) else {
            return;
        };
        let mut ctx = EntityContext::new(&st.id).with_type(&st.type_name, st.live.epoch);
        let res = st.live.entity.on_durable(&mut ctx, durable);
        drop(ctx);
        let keep = res.is_ok() && st.live.entity.on_stopping();
        let (t, id) = (st.type_name.clone(), st.id.clone());
        self.drain_completions();
        if keep {
            self.durable.wait(&t, &id, inc);
            return;
        }
        let Some(mut st) = self.stopping.remove(&inc) else {
            return;
        };
        if let Err(e) = res {
            tracing::warn!(entity = %st.id, error = %e, "entity failed on a durable event while stopping");
            st.reason = TerminatedReason::Failed;
        }
        let tell = st.tell_region;
        self.end_stop(st);
        if tell {
            self.run_effects();
        }
    }

    // ----- remembered entities -----

    /// Starts reading the remembered entities of `shard` (waiting in
    /// `Recovering`): the local journal answers at once, the database on a
    /// reader thread (the durability wake then polls it). A failed read
    /// starts nothing: the shard keeps waiting, its messages buffered in
    /// the region (bounded by `buffer_size` and their deadlines), and the
    /// read is retried after a backoff; the reason is in the regions'
    /// `journal_error` meanwhile.
    fn start_remember_read(&mut self, t: &str, shard: ShardId, failures: u32) {
        use crate::persistence::remember::{self, RememberRead};
        let now = self.now();
        let Some(ty) = self.plane.type_index(t) else {
            return;
        };
        let Some(generation) = self.plane.region(ty).recovering_generation(shard) else {
            return;
        };
        match remember::recover_start(t, self.plane.region(ty), shard) {
            RememberRead::Ready(Ok(ids)) => {
                self.plane.handle_remembered_entities(now, ty, shard, ids);
                self.remember_read_ok();
            }
            RememberRead::Ready(Err(e)) => {
                self.remember_failed(t, shard, generation.0, failures, &e);
            }
            RememberRead::Pending(ticket) => self.remember_reads.push(RememberPending {
                type_name: t.to_string(),
                shard,
                generation: generation.0,
                ticket: Some(ticket),
                retry_at: now,
                failures,
            }),
        }
    }

    fn remember_read_ok(&mut self) {
        if !self.remember_reads.iter().any(|r| r.failures > 0) {
            self.remember_error = None;
        }
    }

    fn remember_failed(
        &mut self,
        t: &str,
        shard: ShardId,
        generation: u64,
        failures: u32,
        e: &crate::persistence::LogError,
    ) {
        let delay = REMEMBER_RETRY_MIN
            .saturating_mul(1 << failures.min(5))
            .min(REMEMBER_RETRY_MAX);
        let why = format!(
            "journal read of remembered entities failed: shard {} of {t}: {e}; the shard \
             waits and the read is retried",
            shard.0
        );
        if failures == 0 {
            tracing::warn!(core = self.index, type_name = t, shard = shard.0, error = %e,
                "remembered entities not read; the shard does not start until they are (retrying)");
        } else {
            tracing::debug!(core = self.index, type_name = t, shard = shard.0, error = %e, "remembered entities not read again");
        }
        self.remember_error = Some(why);
        let now = self.now();
        self.remember_reads.push(RememberPending {
            type_name: t.to_string(),
            shard,
            generation,
            ticket: None,
            retry_at: now + delay,
            failures: failures.saturating_add(1),
        });
    }

    /// Takes the finished reads of remembered entities (their shards start)
    /// and starts the retries that are due; drops reads of shards that are
    /// no longer waiting for them with that generation.
    fn poll_remember_reads(&mut self) {
        use crate::persistence::remember;
        if self.remember_reads.is_empty() {
            return;
        }
        let now = self.now();
        let mut touched: Vec<String> = Vec::new();
        for r in std::mem::take(&mut self.remember_reads) {
            let ty = self.plane.type_index(&r.type_name);
            let current = ty
                .and_then(|ty| self.plane.region(ty).recovering_generation(r.shard))
                .is_some_and(|g| g.0 == r.generation);
            match r.ticket {
                Some(ticket) if !current => remember::recover_forget(ticket),
                Some(ticket) => match remember::recover_poll(&r.type_name, r.shard, ticket) {
                    None => self.remember_reads.push(r),
                    Some(Ok(ids)) => {
                        if let Some(ty) = ty {
                            self.plane.handle_remembered_entities(now, ty, r.shard, ids);
                        }
                        if r.failures > 0 {
                            tracing::info!(core = self.index, type_name = %r.type_name, shard = r.shard.0,
                                "remembered entities read after a retry; the shard starts");
                        }
                        touched.push(r.type_name);
                    }
                    Some(Err(e)) => {
                        self.remember_failed(&r.type_name, r.shard, r.generation, r.failures, &e);
                    }
                },
                None if !current => {}
                None if r.retry_at <= now => {
                    self.start_remember_read(&r.type_name, r.shard, r.failures);
                    touched.push(r.type_name);
                }
                None => self.remember_reads.push(r),
            }
        }
        self.remember_read_ok();
        if !touched.is_empty() {
            self.run_effects();
        }
    }

    fn ensure_entity(&mut self, t: &str, shard: ShardId, id: &EntityId) -> bool {
        let inc = self.next_incarnation;
        let Some(h) = self.types.get_mut(t) else {
            return false;
        };
        if h.entities.contains_key(id) {
            return true;
        }
        let Some(f) = h.factory.as_ref() else {
            return false;
        };
        let mut entity = f(id);
        let mut epoch = 0;
        let mut hosted_max = 0;
        let Some(ty) = self.plane.type_index(t) else {
            return false;
        };
        for (s, g, _) in self.plane.region(ty).hosted_shards() {
            hosted_max = hosted_max.max(g.0);
            if s == shard {
                epoch = g.0;
            }
        }
        crate::persistence::set_hosted_generation(hosted_max);
        let mut ctx = EntityContext::new(id).with_type(t, epoch);
        entity.on_start(&mut ctx);
        let wants_durable = ctx.wants_durable();
        let watches = ctx.take_watches();
        let failed = ctx.wants_failed_stop();
        h.activated += 1;
        h.entities.insert(
            id.clone(),
            Live {
                entity,
                shard,
                incarnation: inc,
                epoch,
            },
        );
        self.next_incarnation += 1;
        let timers = ctx.take_timers();
        self.apply_timers(t, id, inc, timers);
        if wants_durable {
            self.durable.wait(t, id, inc);
        }
        self.apply_watches(t, id, watches, failed);
        true
    }

    /// Hands what a handler asked of its timers to the plane.
    fn apply_timers(
        &mut self,
        t: &str,
        id: &EntityId,
        inc: u64,
        timers: Vec<(u64, Option<Duration>)>,
    ) {
        if timers.is_empty() {
            return;
        }
        if let Some(ty) = self.plane.type_index(t) {
            let now = self.now();
            self.plane.handle_entity_timers(now, ty, id, inc, timers);
        }
    }

    /// Runs an entity's timer `key` if incarnation `inc` still lives.
    fn fire_timer(&mut self, t: &str, id: &EntityId, key: u64, inc: u64) {
        let Some(h) = self.types.get_mut(t) else {
            return;
        };
        let Some(live) = h.entities.get_mut(id) else {
            return;
        };
        if live.incarnation != inc {
            return;
        }
        let shard = live.shard;
        let mut ctx = EntityContext::new(id).with_type(t, live.epoch);
        live.entity.on_timer(&mut ctx, key);
        let out = ctx.take_outgoing();
        let timers = ctx.take_timers();
        let passivate = ctx.wants_passivation();
        let wants_durable = ctx.wants_durable();
        let watches = ctx.take_watches();
        let failed = ctx.wants_failed_stop();
        drop(ctx);
        self.apply_watches(t, id, watches, failed);
        self.apply_timers(t, id, inc, timers);
        self.send_outgoing(out, &mut None, None);
        if wants_durable {
            self.durable.wait(t, id, inc);
        }
        self.drain_completions();
        if passivate {
            self.passivate(t, shard, id);
        }
    }

    fn deliver(&mut self, t: &str, env: UserEnvelope) {
        if let ReplyTo::System(m) = env.sender {
            return self.deliver_system(t, env.entity, *m);
        }
        if !self.ensure_entity(t, env.shard, &env.entity) {
            return self.reply(
                env.sender,
                Status::UnknownEntityType,
                b"type not hosted here".to_vec(),
            );
        }
        let Some(h) = self.types.get_mut(t) else {
            return;
        };
        let Some(live) = h.entities.get_mut(&env.entity) else {
            return;
        };
        h.delivered += 1;
        let token = self.next_tag;
        self.next_tag += 1;
        let epoch = live.epoch;
        let mut ctx = EntityContext::new(&env.entity)
            .with_type(t, epoch)
            .with_reply_token(token);
        let res = live.entity.handle(&mut ctx, &env.payload);
        let inc = live.incarnation;
        let passivate = ctx.wants_passivation();
        let timers = ctx.take_timers();
        let reply = ctx.take_reply().unwrap_or_default();
        let deferred = ctx.reply_deferred();
        let wants_durable = ctx.wants_durable();
        let out = ctx.take_outgoing();
        let watches = ctx.take_watches();
        let failed = ctx.wants_failed_stop();
        drop(ctx);
        self.apply_watches(t, &env.entity, watches, failed);
        let mut sender = Some(env.sender);
        if !out.is_empty() {
            self.send_outgoing(out, &mut sender, env.deadline);
        }
        let sender = sender.unwrap_or(ReplyTo::Nobody);
        match res {
            Ok(()) => {
                if deferred {
                    self.plane.handle_reply_deferred(token, inc, sender);
                    self.drain_completions();
                } else {
                    self.reply(sender, Status::Ok, reply);
                }
                if wants_durable {
                    self.durable.wait(t, &env.entity, inc);
                }
                if !timers.is_empty() {
                    self.apply_timers(t, &env.entity, inc, timers);
                }
                if passivate {
                    self.passivate(t, env.shard, &env.entity);
                }
            }
            Err(e) => {
                self.reply(sender, Status::EntityFailed, e.to_string().into_bytes());
                if let Some(h) = self.types.get_mut(t) {
                    if let Some(mut l) = h.entities.remove(&env.entity) {
                        l.entity.on_stop();
                        self.entity_gone(t, &env.entity, TerminatedReason::Failed);
                    }
                }
                self.fail_deferred(inc);
                self.entity_stopped(t, env.shard, &env.entity);
            }
        }
    }

    // ----- timers -----

    fn tick(&mut self) {
        let now = self.now();
        if self.drain_until.is_some_and(|d| now >= d) {
            self.finish_drain();
        }
        // The regions' and the entities' timers, the deadlines of
        // forwarded messages.
        if self.plane.poll_timeout().is_some_and(|d| d <= now) {
            self.plane.handle_timeout(now);
            self.run_effects();
        }
        self.workers_tick(now);
        // Embedding-API asks past their wait: answered `None` (timed out).
        while self
            .api_expiry
            .peek()
            .is_some_and(|std::cmp::Reverse((due, _))| *due <= now)
        {
            let Some(std::cmp::Reverse((_, id))) = self.api_expiry.pop() else {
                break;
            };
            if let Some(tx) = self.api_waiters.remove(&id) {
                let _ = tx.send(None);
            }
        }
        // Asks of entities past their timeout.
        while self
            .entity_ask_expiry
            .peek()
            .is_some_and(|std::cmp::Reverse((due, _))| *due <= now)
        {
            let Some(std::cmp::Reverse((_, id))) = self.entity_ask_expiry.pop() else {
                break;
            };
            self.answer_entity_ask(id, Err(crate::entity::EntityAskError::TimedOut));
        }
        // Retries of failed reads of remembered entities.
        if self.remember_reads.iter().any(|r| r.ticket.is_none()) {
            self.poll_remember_reads();
        }
        self.flush_system();
    }

    // ----- ring messages -----

    fn on_inbox(core: &DataExecutorRef, m: ToCore) {
        let mut c = core.borrow_mut();
        let now = c.now();
        match m {
            ToCore::RegisterType {
                type_name,
                factory,
                settings,
            } => {
                if c.plane.type_index(&type_name).is_some() {
                    tracing::warn!(type_name, "entity type already started; ignored");
                    return;
                }
                let rs = DataPlane::region_settings(&settings);
                let worker = match (&settings.stateless_worker, &factory) {
                    (Some(w), Some(_)) => Some(workers::WorkerHost::new(
                        w,
                        settings.idle_timeout,
                        c.to_cores.len(),
                        c.index,
                    )),
                    _ => None,
                };
                let hosts = factory.is_some();
                c.plane
                    .handle_register_type(now, &type_name, rs, hosts, worker.is_some());
                c.types.insert(
                    &type_name,
                    TypeHost {
                        factory,
                        entities: FastMap::default(),
                        delivered: 0,
                        activated: 0,
                        worker,
                    },
                );
                c.run_effects();
            }
            ToCore::Region { type_name, msg } => {
                c.plane.handle_region_msg(now, &type_name, msg);
                c.run_effects();
            }
            ToCore::Membership(ev) => {
                if let shardline_core::sharding::MembershipEvent::MemberRemoved(m) = &ev {
                    // Before the regions forget the homes on it.
                    c.watches_member_removed(m);
                }
                // A removed member's lanes close, forwards to it fail.
                c.plane.handle_membership(now, &ev);
                c.run_effects();
            }
            ToCore::CoordinatorMoved => {
                c.plane.handle_coordinator_moved(now);
                c.run_effects();
            }
            ToCore::Available(a) => c.available = a,
            ToCore::GracefulShutdown => {
                c.workers_flush(now);
                c.plane.handle_graceful_shutdown(now);
                c.run_effects();
            }
            ToCore::InboundData { fd, peer } => {
                // SAFETY: the control executor handed over ownership of this
                // connected socket's fd and no longer uses it.
                let std = unsafe { std::net::TcpStream::from_raw_fd(fd) };
                match monoio::net::TcpStream::from_std(std) {
                    Ok(s) => {
                        drop(c);
                        monoio::spawn(serve_data_lane(core.clone(), s, peer));
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot adopt data lane"),
                }
            }
            ToCore::Status { reply } => {
                let _ = reply.send(c.status());
            }
            ToCore::Ask {
                type_name,
                entity,
                payload,
                timeout,
                reply,
            } => {
                let sender = match reply {
                    None => ReplyTo::Nobody,
                    Some(r) => {
                        let id = c.next_tag;
                        c.next_tag += 1;
                        c.api_waiters.insert(id, r.tx);
                        c.api_expiry
                            .push(std::cmp::Reverse((now.saturating_add(r.wait), id)));
                        ReplyTo::Api { id }
                    }
                };
                let shard = shard_id_of(entity.as_str(), c.config.number_of_shards);
                // The deadline of an HTTP or native request: a message still
                // buffered then is answered `Unavailable`, never delivered
                // later.
                let limit = c.config.requests.ask_timeout();
                let env = Envelope {
                    deadline: Some(now + timeout.map_or(limit, |t| t.min(limit))),
                    entity,
                    shard,
                    sender,
                    payload,
                };
                c.route(&type_name, env);
            }
            ToCore::Forwarded {
                type_name,
                envelope,
            } => c.route(&type_name, envelope),
            ToCore::AskReply {
                id,
                status,
                payload,
            } => {
                let reply = if status == Status::Ok {
                    Ok(payload)
                } else {
                    Err(crate::entity::EntityAskError::Failed { status, payload })
                };
                c.answer_entity_ask(id, reply);
            }
            ToCore::LocalReply {
                token,
                status,
                payload,
            } => {
                c.plane.handle_local_reply(token, status, payload);
                c.run_effects();
            }
            ToCore::Stop => c.stop_node(),
            ToCore::Shutdown => c.shutdown = true,
        }
    }

    /// The node stopped (left or downed) or exits: every message the
    /// regions still buffer is answered `ShuttingDown` (not delivered;
    /// counted as a dead letter with reason `shutting_down`, logged in
    /// aggregate), the entities stop, and the stop drain begins
    /// ([`STOP_DRAIN`]): requests that still arrive are answered
    /// `ShuttingDown`, then the connections close.
    fn stop_node(&mut self) {
        if self.plane.is_stopped() {
            return;
        }
        let now = self.now();
        let answered = self.plane.handle_stop();
        self.run_effects();
        let types: Vec<Rc<str>> = self.types.keys().cloned().collect();
        for t in types {
            let live: Vec<(EntityId, Live)> = match self.types.get_mut(&t) {
                Some(h) => h.entities.drain().collect(),
                None => Vec::new(),
            };
            // Entities with appends in flight stop when those have an
            // outcome (within the stop drain; `finish_drain` stops the
            // rest).
            for (id, l) in live {
                self.begin_stop(&t, id, l, TerminatedReason::NodeStopped, false);
            }
        }
        for r in std::mem::take(&mut self.remember_reads) {
            if let Some(ticket) = r.ticket {
                crate::persistence::remember::recover_forget(ticket);
            }
        }
        self.workers_stop();
        self.drain_completions();
        self.flush_system();
        if answered > 0 {
            tracing::warn!(
                core = self.index,
                answered,
                "node stopped: buffered messages answered ShuttingDown (not delivered; dead letters)"
            );
        }
        self.drain_until = Some(now + STOP_DRAIN);
    }

    /// Ends the stop drain: messages forwarded to other nodes or cores
    /// without a reply yet are answered `TimedOut` (they may have reached
    /// their entity), and every connection is closed (its writer still
    /// writes what is queued).
    fn finish_drain(&mut self) {
        if self.drained {
            return;
        }
        self.drained = true;
        let stopping: Vec<u64> = self.stopping.keys().copied().collect();
        for inc in stopping {
            if let Some(st) = self.stopping.remove(&inc) {
                self.end_stop(st);
            }
        }
        let unanswered = self.plane.handle_drain_end();
        self.run_effects();
        if unanswered > 0 {
            tracing::warn!(
                core = self.index,
                unanswered,
                "node stopped: forwarded messages without a reply answered TimedOut"
            );
        }
        for o in self.conns.values() {
            o.close();
        }
        for l in self.links.values() {
            l.outbox.close();
        }
    }

    pub(crate) fn status(&self) -> Vec<RegionStatusView> {
        // A journal that did not open, or a database that is unavailable.
        let journal_error = self
            .journal_error
            .clone()
            .or_else(|| crate::persistence::with_log(|l| l.health()).ok().flatten())
            .or_else(|| self.remember_error.clone());
        let mut v: Vec<RegionStatusView> = self
            .types
            .entries
            .iter()
            .enumerate()
            .map(|(i, (t, h))| {
                let region = self.plane.region(TypeIdx(i));
                let st = region.shard_region_state();
                RegionStatusView {
                    type_name: t.to_string(),
                    core: self.index,
                    proxy: region.is_proxy(),
                    registered: region.is_registered(),
                    homes_known: region.known_homes(),
                    entities: h.entities.len(),
                    shards: st
                        .shards
                        .into_iter()
                        .map(|(s, ids)| {
                            (
                                s.0,
                                ids.into_iter().map(|i| i.as_str().to_string()).collect(),
                            )
                        })
                        .collect(),
                    messages_delivered: h.delivered,
                    entities_activated: h.activated,
                    dead_letters: region.dead_letters(),
                    journal_error: journal_error.clone(),
                    dead_letter_reasons: region
                        .dead_letters_by_reason()
                        .into_iter()
                        .filter(|(_, n)| *n > 0)
                        .map(|(r, n)| (r.label().to_string(), n))
                        .collect(),
                    buffered: region.buffered(),
                    hand_offs_begun: region.hand_offs_begun(),
                    hand_offs_completed: region.hand_offs_completed(),
                    worker: h.worker.as_ref().map(|w| w.status()),
                }
            })
            .collect();
        v.sort_by(|a, b| a.type_name.cmp(&b.type_name));
        v
    }

    /// The homes of `shard` this core's regions have cached from the
    /// coordinator, per entity type: `(type, member address, core)`.
    pub(crate) fn cached_homes(&self, shard: ShardId) -> Vec<crate::gateway::http::CachedHome> {
        let mut out: Vec<_> = (0..self.plane.type_count())
            .filter_map(|i| {
                let ty = TypeIdx(i);
                self.plane.region(ty).home_of(shard).map(|(r, _)| {
                    (
                        self.plane.type_name(ty).to_string(),
                        r.member.address.0.clone(),
                        r.core,
                    )
                })
            })
            .collect();
        out.sort();
        out
    }

    pub(crate) fn index(&self) -> u16 {
        self.index
    }

    pub(crate) fn to_cores(&self) -> &[RingSender<ToCore>] {
        &self.to_cores
    }

    /// The longest request frame the native front reads, in bytes
    /// (`requests.max_message_size_bytes` plus the envelope's overhead).
    pub(crate) fn max_request_frame_bytes(&self) -> usize {
        self.config.requests.max_request_frame_bytes()
    }

    pub(crate) fn to_control(&self) -> &RingSender<ToControl> {
        &self.to_control
    }

    pub(crate) fn me(&self) -> &UniqueAddress {
        &self.me
    }

    pub(crate) fn client_address(&self) -> String {
        self.config.client_address.to_string()
    }
}

/// An outbound data lane to a remote region: connect, handshake, then write
/// batched `Forward`s and read `Reply`s until it fails.
async fn run_link(core: DataExecutorRef, to: RegionId, outbox: Rc<Outbox>) {
    let (hello, addr) = {
        let c = core.borrow();
        let hello = c.fp.hello(
            (&c.me.address.0, c.me.uid.0),
            Lane::Data,
            to.core,
            c.scope.cluster_id(),
        );
        (hello, to.member.address.0.parse::<std::net::SocketAddr>())
    };
    let connected = std::cell::Cell::new(false);
    let result: Result<(), crate::transport::TransportError> = async {
        let addr = addr.map_err(|e| {
            crate::transport::TransportError::Refused(format!("bad member address: {e}"))
        })?;
        let mut stream = transport::connect(addr, Duration::from_secs(2)).await?;
        let mut reader = FrameReader::new(MAX_FRAME_SIZE_BYTES);
        let ack = transport::client_handshake(&mut stream, &mut reader, &hello).await?;
        if ack.uid != to.member.uid.0 {
            return Err(crate::transport::TransportError::Refused(format!(
                "{} is incarnation {}, not {}",
                ack.address, ack.uid, to.member.uid.0
            )));
        }
        connected.set(true);
        let (mut r, mut w) = stream.into_split();
        let wb = outbox.clone();
        let writer = monoio::spawn(async move { transport::write_loop(&mut w, wb).await });
        loop {
            let range = reader.read_frame(&mut r).await?;
            core.borrow_mut().on_link_frame(reader.body(range))?;
            while let Some(range) = reader.next_frame()? {
                core.borrow_mut().on_link_frame(reader.body(range))?;
            }
            if outbox.closed.get() {
                break;
            }
        }
        outbox.close();
        let _ = writer.await;
        Ok(())
    }
    .await;
    if let Err(e) = &result {
        tracing::debug!(to = %to.member, core = to.core, error = %e, "data lane failed");
    }
    outbox.close();
    core.borrow_mut().link_failed(&to, &outbox, connected.get());
}

/// An inbound data lane: read `Forward`s, route them, write `Reply`s.
async fn serve_data_lane(
    core: DataExecutorRef,
    stream: monoio::net::TcpStream,
    peer: UniqueAddress,
) {
    let outbox = Rc::new(Outbox::default());
    let conn = core.borrow_mut().add_conn(outbox.clone());
    let (mut r, mut w) = stream.into_split();
    let wb = outbox.clone();
    monoio::spawn(async move {
        let _ = transport::write_loop(&mut w, wb).await;
    });
    let mut reader = FrameReader::new(MAX_FRAME_SIZE_BYTES);
    let why: String = loop {
        match reader.fill(&mut r).await {
            Ok(0) => break "closed".into(),
            Ok(_) => {}
            Err(e) => break e.to_string(),
        }
        let mut err = None;
        loop {
            match reader.next_frame() {
                Ok(Some(range)) => {
                    if let Err(e) = core.borrow_mut().on_data_frame(conn, reader.body(range)) {
                        err = Some(e.to_string());
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    err = Some(e.to_string());
                    break;
                }
            }
        }
        if let Some(e) = err {
            tracing::warn!(peer = %peer, error = %e, "protocol error on data lane; closing it");
            break e;
        }
    };
    tracing::debug!(peer = %peer, why, "data lane closed");
    core.borrow_mut().remove_conn(conn);
}

/// The data plane's side of the port to the fronts of this executor.
impl DataPort for DataExecutorRef {
    fn open_conn(&self, signal: Rc<Outbox>) -> ConnId {
        self.borrow_mut().add_conn(signal)
    }

    fn close_conn(&self, conn: ConnId) {
        self.borrow_mut().remove_conn(conn);
    }

    fn max_request_frame_bytes(&self) -> usize {
        self.borrow().max_request_frame_bytes()
    }

    fn client_request(
        &self,
        conn: ConnId,
        request_id: u64,
        type_name: &[u8],
        entity_id: &[u8],
        payload: Vec<u8>,
    ) {
        self.borrow_mut()
            .client_request(conn, request_id, type_name, entity_id, payload);
    }

    fn cached_homes(&self, shard: ShardId) -> Vec<crate::gateway::http::CachedHome> {
        self.borrow().cached_homes(shard)
    }

    fn node_status(&self) -> impl std::future::Future<Output = Option<super::NodeStatus>> {
        super::admin::collect_status(self)
    }

    fn coordinator_admin(
        &self,
        cmd: crate::status::CoordinatorCommand,
    ) -> impl std::future::Future<Output = crate::status::AdminAnswer> {
        super::admin::coordinator_admin(self, cmd)
    }

    fn cluster_stats(
        &self,
        type_name: &str,
        local: &super::NodeStatus,
        wait: Duration,
    ) -> impl std::future::Future<Output = Option<crate::status::ClusterShardingStats>> {
        super::admin::collect_cluster_stats(self, type_name, local, wait)
    }
}
