//! A data executor: the driver of one core's data plane
//! ([`DataPlane`], `node/plane/data.rs`, which owns the regions and makes
//! the routing decisions) and of its entity host ([`EntityHost`],
//! `node/plane/host.rs`, which runs the entities), of the data lanes to
//! other nodes (`core/lanes.rs`), and of the fronts (`crate::gateway`) it
//! starts and serves through `DataPort` (`core/port.rs`), answering them
//! through their reply sink ([`Fronts::reply`]). It keeps the sockets, the
//! spawns, the tick, the rings, the journal handles and the embedding
//! API's waiting asks, and decides nothing about sharding.
//!
//! Everything here runs on one thread; the state is one
//! `Rc<RefCell<DataExecutor>>` borrowed for the length of one input (a
//! frame, a ring message, a tick), never across an await. Each input is
//! fed to the plane (or the host), then their outputs are carried out
//! ([`DataExecutor::run_effects`]); entities run to completion inside that
//! borrow.

use crate::runtime::limited;
use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap};
use std::os::fd::FromRawFd;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shardline_core::ids::{Address, MemberUid, RegionId, UniqueAddress};
use shardline_core::sharding::{shard_id_of, Envelope};

use super::msg::{ReplyTo, ToControl, ToCore, UserEnvelope};
use super::plane::data::{DataOutput, DataPlane, DataPlaneConfig, Transmit, TypeIdx};
use super::plane::host::{EntityHost, HostConfig, HostOutput, SYSTEM_ROUNDS};
use super::Shared;
use crate::config::NodeConfig;
use crate::envelope::{encode_frame, DataFrame, Status};
use crate::gateway::{Delivered, Fronts, MetricsBoard};
use crate::runtime::{RingReceiver, RingSender};
use crate::transport::{self, Outbox};
use crate::FastMap;

mod lanes;
mod port;

use lanes::{run_link, serve_data_lane};

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
    /// The node's PostgreSQL journal backend, when `journal.backend =
    /// "postgres"` (one per node, shared by its cores' logs).
    pub pg_journal: Option<Arc<crate::persistence::pg::PgJournal>>,
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

/// Outputs [`DataExecutor::drain_outputs`] carries out per clock read.
const DRAIN_CLOCK_EVERY: u32 = 32;

/// The id of an embedding-API ask waiting for its answer
/// (`ReplyTo::Api`); its own id space on each core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct ApiAskId(u64);

struct Link {
    outbox: Rc<Outbox>,
}

pub(crate) struct DataExecutor {
    index: u16,
    me: UniqueAddress,
    epoch: Instant,
    /// The latest time (since `epoch`) handed to the plane: a front's read
    /// time can be older than a clock read made since, and the plane's
    /// time must not go back.
    last_now: std::cell::Cell<Duration>,
    config: NodeConfig,
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
    /// The entities: their code, asks, watches, stops, remembered reads.
    host: EntityHost,
    next_api_ask: u64,
    api_waiters: FastMap<ApiAskId, crate::api::oneshot::Sender<super::msg::ApiAnswer>>,
    /// When the core stops waiting for an API ask's answer: (due, id).
    api_expiry: BinaryHeap<std::cmp::Reverse<(Duration, ApiAskId)>>,
    to_control: RingSender<ToControl>,
    to_cores: Vec<RingSender<ToCore>>,
    available: bool,
    shutdown: bool,
    /// [`ToCore::Shutdown`] arrived: exit once the stop drain is over.
    exit_requested: bool,
    /// When the stop drain ends (set when the node stops).
    drain_until: Option<Duration>,
    /// The stop drain is over: connections closed.
    drained: bool,
    /// Set while [`DataExecutor::run_effects`] routes the host's lifecycle
    /// messages (no re-entry).
    flushing_system: bool,
    /// Why this core's journal could not be opened (durable entities then
    /// fail and `/health/ready` answers 503).
    journal_error: Option<String>,
    /// The node's data scope (cluster id for the data lanes' hellos).
    scope: Arc<crate::persistence::DataScope>,
    /// What this node's hellos carry.
    fp: crate::transport::Fingerprint,
}

pub(crate) type DataExecutorRef = Rc<RefCell<DataExecutor>>;

/// Runs a data executor until [`ToCore::Shutdown`].
pub(crate) async fn run(init: DataExecutorInit) {
    let me = UniqueAddress {
        address: Address(init.config.cluster_address.to_string().into()),
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
    let host = EntityHost::new(HostConfig::from_node_config(
        &init.config,
        init.index,
        init.to_cores.len(),
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
            last_now: std::cell::Cell::new(Duration::ZERO),
            config: init.config,
            conns: FastMap::default(),
            next_conn: 1,
            links: HashMap::new(),
            host,
            next_api_ask: 1,
            api_waiters: FastMap::default(),
            api_expiry: BinaryHeap::new(),
            to_control: init.to_control,
            to_cores: init.to_cores,
            available: false,
            shutdown: false,
            exit_requested: false,
            drain_until: None,
            drained: false,
            flushing_system: false,
            journal_error: None,
        })
    });
    drop(init.shared);
    {
        let mut c = core.borrow_mut();
        if let Some(pg) = init.pg_journal.as_ref() {
            // Each turn's appends go to the core's writer thread in one
            // batch: this task runs after the turn's other ready tasks.
            let flush = Arc::new(crate::persistence::DurableWake::default());
            let journal = crate::persistence::CoreJournal::open_postgres(
                pg,
                c.index,
                &c.host.durable_wake(),
                &flush,
            );
            c.host.set_journal(journal);
            let flush_core = core.clone();
            monoio::spawn(async move {
                loop {
                    flush.wait().await;
                    let mut fc = flush_core.borrow_mut();
                    if let Ok(l) = fc.host.journal_mut().log() {
                        l.flush();
                    }
                    if fc.shutdown {
                        return;
                    }
                }
            });
        } else {
            match crate::persistence::CoreJournal::open_local(
                &c.config.data_dir,
                c.index,
                &c.config.durability,
                Some(c.scope.clone()),
            ) {
                Ok(journal) => {
                    if let Some(h) = journal.flush_latency() {
                        c.fronts.set_journal_flush_latency(c.index, h);
                    }
                    c.host.set_journal(journal);
                }
                Err(e) => {
                    tracing::error!(core = c.index, error = %e, "cannot open the core's journal; durable entities fail; the node is not ready");
                    c.journal_error = Some(e.to_string());
                    let _ = c
                        .to_control
                        .send(ToControl::JournalFailed { core: c.index });
                }
            }
        }
    }
    let durable_core = core.clone();
    let wake = core.borrow().host.durable_wake();
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
                    // EMFILE would repeat every 10 ms.
                    limited!(warn, error = %e, "accept failed");
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
    let journal = core.borrow_mut().host.journal_mut().take();
    drop(journal); // syncs and closes the core's journal
}

impl DataExecutor {
    pub(crate) fn now(&self) -> Duration {
        self.now_at(Instant::now())
    }

    /// The plane's time for an event that happened at `at` (a front's read
    /// time): `at` since the epoch, never earlier than a time already
    /// handed to the plane.
    fn now_at(&self, at: Instant) -> Duration {
        let now = at
            .saturating_duration_since(self.epoch)
            .max(self.last_now.get());
        self.last_now.set(now);
        now
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

    /// Answers a sender: a front's connection (through the fronts' reply
    /// sink, dropped when its connection is gone), an inbound data lane,
    /// another core's ring, an API ask, or an entity's ask (through this
    /// core's own inbox). A system message's failure is the host's.
    fn reply(&mut self, to: ReplyTo, status: Status, payload: Vec<u8>) {
        match to {
            ReplyTo::Nobody => {}
            ReplyTo::Client { conn, request_id } => {
                // The reply's latency is read at its delivery: it includes
                // the entity's handler (the drain's time may be the
                // request's read time).
                if let Delivered::Written(buf) =
                    self.fronts.reply(conn, request_id, status, payload)
                {
                    self.host.recycle_reply(buf);
                }
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
                    if let DataFrame::Reply { payload, .. } = f {
                        self.host.recycle_reply(payload);
                    }
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
                if let Some(tx) = self.api_waiters.remove(&ApiAskId(id)) {
                    // The asker may have dropped its future: the answer
                    // is dropped with it.
                    let _ = tx.send(Some((status, payload)));
                }
            }
            ReplyTo::EntityAsk { id } => {
                if !self.host.awaits_ask(crate::entity::AskId(id)) {
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
                // Only the host's replies carry these; kept for safety.
                let now = self.now();
                let _ = self.host.handle_plane_output(
                    now,
                    &mut self.plane,
                    DataOutput::Reply {
                        to: ReplyTo::System(m),
                        status,
                        payload,
                    },
                );
            }
        }
    }

    // ----- client requests -----

    /// Routes one entity request of a front (see
    /// [`DataPort::client_request`]): the front's read time `read_at` is
    /// the plane's current time for it and its effects (no clock read of
    /// its own).
    pub(crate) fn client_request(
        &mut self,
        conn: u64,
        request_id: u64,
        type_name: &[u8],
        entity_id: &[u8],
        payload: bytes::Bytes,
        read_at: Instant,
    ) {
        let now = self.now_at(read_at);
        self.plane
            .handle_client_request(now, conn, request_id, type_name, entity_id, payload);
        self.run_effects_at(now);
    }

    /// Hands a user message to this core's region of `t` and runs the effects
    /// (a stateless worker type's message runs on its pool).
    fn route(&mut self, t: &str, env: UserEnvelope) {
        let now = self.now();
        self.plane.handle_message(now, t, env);
        self.run_effects();
    }

    // ----- effects -----

    /// Carries out the plane's and the host's outputs until neither has any
    /// (the plane's entity outputs go to the host, whose handlers may feed
    /// the plane more), then routes the host's lifecycle messages, bounded
    /// per call (the rest waits for the next tick).
    fn run_effects(&mut self) {
        let now = self.now();
        self.run_effects_at(now);
    }

    /// [`Self::run_effects`] with the current time `now` (since the
    /// executor's epoch) read by the caller.
    fn run_effects_at(&mut self, now: Duration) {
        self.drain_outputs(now);
        if self.flushing_system {
            return;
        }
        self.flushing_system = true;
        for _ in 0..SYSTEM_ROUNDS {
            let system = self.host.take_system();
            if system.is_empty() {
                break;
            }
            for (t, env) in system {
                let now = self.now();
                self.plane.handle_message(now, &t, env);
                self.drain_outputs(now);
            }
        }
        self.flushing_system = false;
    }

    /// Carries out the plane's and the host's outputs, starting at the
    /// current time `now` (since the executor's epoch) read by the caller.
    fn drain_outputs(&mut self, mut now: Duration) {
        // One clock read per DRAIN_CLOCK_EVERY outputs, not one per output
        // (a counter add's outputs read the clock two to three times here,
        // about 1 % of the data core): the plane and the host see a time at
        // most that many outputs old (tens of µs), against timeouts of ms.
        let mut since_clock = 0u32;
        loop {
            self.carry_host_outputs();
            if since_clock == DRAIN_CLOCK_EVERY {
                now = self.now();
                since_clock = 0;
            } else {
                // Not behind a time a nested call handed the plane.
                now = now.max(self.last_now.get());
            }
            since_clock += 1;
            let Some(o) = self.plane.poll_output(now) else {
                break;
            };
            let Some(o) = self.host.handle_plane_output(now, &mut self.plane, o) else {
                continue;
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
                    if let Err(envelope) = self.send_to_core(core, type_name, envelope) {
                        self.plane.handle_core_refused(envelope);
                    }
                }
                // The host carries out the entities' outputs.
                DataOutput::Deliver { .. }
                | DataOutput::ToWorker { .. }
                | DataOutput::StartEntity { .. }
                | DataOutput::StopEntity { .. }
                | DataOutput::TimerFired { .. }
                | DataOutput::Persist { .. }
                | DataOutput::RecoverRememberedEntities { .. } => {}
            }
        }
    }

    /// Hands a user message to core `core`'s ring; gives it back when the
    /// ring is full or closed (or there is no such core).
    fn send_to_core(
        &self,
        core: u16,
        type_name: compact_str::CompactString,
        envelope: UserEnvelope,
    ) -> Result<(), UserEnvelope> {
        let Some(tx) = self.to_cores.get(usize::from(core)) else {
            return Err(envelope);
        };
        match tx.send(ToCore::Forwarded {
            type_name,
            envelope,
        }) {
            Ok(()) => Ok(()),
            Err(
                crate::runtime::RingSendError::Full(m) | crate::runtime::RingSendError::Closed(m),
            ) => match m {
                ToCore::Forwarded { envelope, .. } => Err(envelope),
                _ => unreachable!("the ring gives back the message it was given"),
            },
        }
    }

    /// Carries out what the host asked (replies, messages between
    /// entities through this core's own inbox).
    fn carry_host_outputs(&mut self) {
        while let Some(o) = self.host.poll_output() {
            match o {
                HostOutput::Reply {
                    to,
                    status,
                    payload,
                } => self.reply(to, status, payload),
                HostOutput::Send {
                    type_name,
                    envelope,
                } => {
                    if let Err(envelope) = self.send_to_core(self.index, type_name.into(), envelope)
                    {
                        tracing::warn!(
                            core = self.index,
                            "message between entities dropped: inbox full or closed"
                        );
                        self.reply(
                            envelope.sender,
                            Status::BufferFull,
                            b"core inbox full".to_vec(),
                        );
                    }
                }
            }
        }
    }

    /// The journal's durable LSN advanced: the host's entities with events
    /// in flight run their handlers and answer.
    fn on_durable_advance(&mut self) {
        let journal = self.host.journal_mut();
        journal.disarm_if_reached();
        let Some(durable) = journal.log_ref().map(|l| l.durable_lsn().0) else {
            return;
        };
        let now = self.now();
        self.host.handle_durable(now, &mut self.plane, durable);
        self.run_effects();
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
        // The entities' asks, remembered-entity read retries, worker pools.
        if self.host.has_workers() || self.host.poll_timeout().is_some_and(|d| d <= now) {
            self.host.handle_timeout(now, &mut self.plane);
        }
        // The journal's housekeeping, which appends also do on the way.
        if let Ok(l) = self.host.journal_mut().log() {
            l.maintain();
        }
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
        self.run_effects();
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
                let worker = settings
                    .stateless_worker
                    .as_ref()
                    .filter(|_| factory.is_some());
                let hosts = factory.is_some();
                c.plane
                    .handle_register_type(now, &type_name, rs, hosts, worker.is_some());
                c.host.handle_register_type(
                    &type_name,
                    factory,
                    worker.map(|w| (w, settings.idle_timeout)),
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
                    let c = &mut *c;
                    c.host.handle_member_removed(&c.plane, m);
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
                let c = &mut *c;
                c.host.handle_graceful_shutdown(now, &mut c.plane);
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
                        let id = ApiAskId(c.next_api_ask);
                        c.next_api_ask += 1;
                        c.api_waiters.insert(id, r.tx);
                        c.api_expiry
                            .push(std::cmp::Reverse((now.saturating_add(r.wait), id)));
                        ReplyTo::Api { id: id.0 }
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
                    payload: payload.into(),
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
                let c = &mut *c;
                c.host
                    .handle_ask_reply(now, &mut c.plane, crate::entity::AskId(id), reply);
                c.run_effects();
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
        // Entities with appends in flight stop when those have an outcome
        // (within the stop drain; `finish_drain` stops the rest).
        self.host.handle_node_stop(now, &mut self.plane);
        self.run_effects();
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
        let now = self.now();
        self.host.handle_drain_end(now, &mut self.plane);
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
