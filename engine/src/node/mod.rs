//! The embedding API: a running node.
//!
//! ```text
//! Node::start(config) ──► control executor (membership, coordinator, transport)
//!                    └──► data executor 0..data_cores (gateway, regions, entities)
//! node.sharding().start("counter", factory, settings) ──► one ShardRegion per data core
//! node.entity_ref("counter", "a").ask(b"add 1", timeout) ──► region ──► home ──► entity
//! node.leave() ──► hand off shards, leave the cluster, stop the executors
//! ```
//!
//! The node makes no sharding or membership decision itself: the control
//! executor feeds `shardline_core::cluster::ClusterNode` and the
//! `ShardCoordinator`, each data executor feeds its `ShardRegion`s, and
//! they carry out the effects those state machines return.

pub(crate) mod admin;
mod control;
pub(crate) mod core;
pub(crate) mod msg;
pub(crate) mod plane;
#[doc(hidden)]
pub use msg::{ClusterView, StatsEvent};
pub(crate) mod watch;

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardline_core::cluster::ClusterEvent;
use shardline_core::ids::{EntityId, IdError, MemberUid, TypeName};
use thiserror::Error;

pub(crate) use crate::api::ApiAnswer;
pub use crate::api::AskError;
use crate::config::NodeConfig;
use crate::entity::EntityFactory;
use crate::envelope::Status;
use crate::runtime::{ring, RingSender};
pub use crate::status::{CoordinatorStatusView, MemberStatusView, NodeStatus, RegionStatusView};
pub(crate) use msg::{ToControl, ToCore};

/// Errors from starting a node.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// An address could not be bound.
    #[error("cannot bind {what} {addr}: {source}")]
    Bind {
        /// Which address (`cluster_address`, `client_address`).
        what: &'static str,
        /// The address.
        addr: std::net::SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// An executor thread could not be started.
    #[error("cannot start executor: {0}")]
    Spawn(std::io::Error),
    /// The node did not become ready in time.
    #[error("not ready after {0:?}")]
    NotReady(Duration),
    /// The node has stopped.
    #[error("node stopped")]
    Stopped,
    /// The `data_dir` is locked by another node, records another cluster,
    /// or its identity files cannot be read or written.
    #[error(transparent)]
    DataDir(#[from] crate::persistence::IdentityError),
    /// The node stopped instead of joining: the cluster it reached is not
    /// its own (another cluster name or id), or its members keep durable
    /// state in journals this node cannot share (`journal.backend`).
    #[error("refused to join the cluster: {0}")]
    Refused(String),
    /// The shared journal backend (`journal.backend = "postgres"`) could
    /// not be reached at start to read its identity, or refused.
    #[error("journal.backend = \"postgres\": {0}")]
    Journal(crate::persistence::pg::PgError),
    /// The entity type (named here) is already started on this node, by an
    /// earlier start of any kind (`Sharding::start`, `start_typed`,
    /// `start_persistent`, `start_stateless_worker`, `start_proxy`) or by
    /// the config's `[[entity_types]]`: a type has one factory and one set
    /// of settings per node, and the first start stays.
    #[error("entity type `{0}` is already started on this node; its first start stays")]
    AlreadyStarted(String),
    /// [`Node::status`]: the control executor did not answer within the
    /// given time.
    #[error("no status from the node's control executor within {0:?}")]
    StatusTimedOut(Duration),
}

/// Settings of one entity type's regions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntitySettings {
    /// Idle passivation timeout; `None` disables it. Default 120 s.
    pub idle_timeout: Option<Duration>,
    /// Maximum live entities per region (count); `None` = unlimited (default).
    pub active_entity_limit: Option<usize>,
    /// Most messages buffered per region while shard homes are unknown
    /// (count). Default 100,000.
    pub buffer_size: usize,
    /// Remember entities in the core's journal and restart them when their
    /// shard starts. Default false.
    pub remember_entities: bool,
    /// Pace of restarting remembered entities. Default all at once.
    pub remember_entities_pace: shardline_core::sharding::RememberEntitiesPace,
    /// `Some`: the type is a stateless worker (Orleans semantics, see
    /// [`crate::entity::worker`]): a request runs on a local activation of
    /// the node that received it, never routed to a shard; `idle_timeout`
    /// collects idle activations (`None`: never). Default `None`.
    pub stateless_worker: Option<crate::entity::worker::WorkerSettings>,
}

impl Default for EntitySettings {
    fn default() -> Self {
        EntitySettings {
            idle_timeout: Some(Duration::from_secs(120)),
            active_entity_limit: None,
            buffer_size: 100_000,
            remember_entities: false,
            remember_entities_pace: shardline_core::sharding::RememberEntitiesPace::AllAtOnce,
            stateless_worker: None,
        }
    }
}

/// State shared between the handle and the executors (admin only, never on
/// the data path).
pub(crate) struct Shared {
    pub ready: AtomicBool,
    /// 0 running, 1 left, 2 downed, 3 stopped, 4 refused to join.
    pub stopped: AtomicU8,
    /// Why the node refused to join (with `stopped` = 4).
    pub refusal: Mutex<Option<String>>,
    pub subscribers: Mutex<Vec<crossbeam_channel::Sender<ClusterEvent>>>,
}

/// A running node.
pub struct Node {
    config: NodeConfig,
    uid: MemberUid,
    to_control: RingSender<ToControl>,
    to_cores: Vec<RingSender<ToCore>>,
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// The `data_dir`'s lock, released after the executors stopped.
    _lock: crate::persistence::DataDirLock,
    /// The entity types started on this node (a second start is refused).
    started_types: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl Node {
    /// Starts the executors, binds the addresses, joins the cluster through
    /// the seeds and starts the configured built-in entity types.
    ///
    /// The `data_dir` is created if needed and locked for the life of the
    /// node; its identity is checked (see
    /// [`crate::persistence::identity`]).
    ///
    /// # Errors
    /// [`NodeError::Config`] for a bad config, [`NodeError::DataDir`] when
    /// the `data_dir` is in use by another node (naming its pid) or records
    /// another `cluster_name`, [`NodeError::Bind`] when an address is
    /// taken (an address in use is retried for up to
    /// [`BIND_RETRY_TIMEOUT`] first), [`NodeError::Spawn`].
    pub fn start(mut config: NodeConfig) -> Result<Node, NodeError> {
        config.validate(std::path::Path::new("<config>"))?;
        if let Some(f) =
            crate::runtime::open_file_limit().and_then(|files| config.fit_connection_limits(files))
        {
            tracing::warn!(
                open_files = f.open_files,
                needed = f.needed,
                max_native_connections_per_core = f.native.1,
                max_http_connections_per_core = f.http.map(|h| h.1),
                "the connection limits need more descriptors than the open file limit leaves for connections; lowered to fit (raise the limit, e.g. systemd's LimitNOFILE, or lower requests.max_native_connections_per_core and http.max_connections_per_core)"
            );
        }
        let lock = crate::persistence::DataDirLock::acquire(&config.data_dir)?;
        let mut scope =
            crate::persistence::DataScope::open(&config.data_dir, &config.cluster_name)?;
        let pg_settings = crate::persistence::pg::PgSettings::from_config(&config.journal);
        if let Some(pg) = pg_settings.as_ref() {
            // On the caller's thread, before any executor runs: the database's
            // identity joins the handshake's fingerprint.
            let id = crate::persistence::pg::identity(pg).map_err(NodeError::Journal)?;
            scope.use_shared_journal(id);
            // The database holds the cluster's identity: a fresh data_dir
            // adopts the id recorded for the cluster's name.
            let proposed = scope
                .recorded_cluster_id()
                .map_or_else(crate::persistence::identity::random_id, str::to_string);
            let cluster_id =
                crate::persistence::pg_control::cluster_id(pg, &config.cluster_name, &proposed)
                    .map_err(NodeError::Journal)?;
            scope.use_database_cluster_id(&cluster_id)?;
        }
        let scope = Arc::new(scope);
        let uid = MemberUid(rand::random::<u64>() | 1);
        let shared = Arc::new(Shared {
            ready: AtomicBool::new(false),
            stopped: AtomicU8::new(0),
            refusal: Mutex::new(None),
            subscribers: Mutex::new(Vec::new()),
        });
        let cores = usize::from(config.data_cores);
        let (to_control, control_rx) = ring::<ToControl>(64 * 1024);
        let mut to_cores = Vec::new();
        let mut core_rxs = Vec::new();
        for _ in 0..cores {
            let (tx, rx) = ring::<ToCore>(64 * 1024);
            to_cores.push(tx);
            core_rxs.push(rx);
        }
        // Bind in the caller's thread so that errors are reported here. An
        // address still held (by the listener of a process that just died,
        // see `bind_with_retry`) is retried for up to BIND_RETRY_TIMEOUT.
        let cluster_listener = bind_with_retry("cluster_address", config.cluster_address, || {
            std::net::TcpListener::bind(config.cluster_address)
        })?;
        let probe = bind_with_retry("client_address", config.client_address, || {
            reuse_port_probe(config.client_address)
        })?;
        let http_probe = match config.http_address {
            Some(addr) => Some(bind_with_retry("http_address", addr, || {
                reuse_port_probe(addr)
            })?),
            None => None,
        };
        let ncpu = core_affinity::get_core_ids().map(|v| v.len()).unwrap_or(1);
        let mut threads = Vec::new();
        let epoch = Instant::now();
        let metrics_board = Arc::new(crate::gateway::MetricsBoard::default());
        // One backend per node: its reader pool and health serve every core.
        let pg_journal = pg_settings
            .as_ref()
            .map(crate::persistence::pg::PgJournal::new);
        for (i, rx) in core_rxs.into_iter().enumerate() {
            let ctx = core::DataExecutorInit {
                index: i as u16,
                config: config.clone(),
                uid,
                epoch,
                inbox: rx,
                to_control: to_control.clone(),
                to_cores: to_cores.clone(),
                shared: shared.clone(),
                scope: scope.clone(),
                pg_journal: pg_journal.clone(),
                metrics_board: metrics_board.clone(),
            };
            let pin = (config.pin_cores && ncpu > 1).then_some(i % ncpu);
            threads.push(
                crate::runtime::spawn_executor(format!("shardline-data-{i}"), pin, move || {
                    core::run(ctx)
                })
                .map_err(NodeError::Spawn)?,
            );
        }
        let cinit = control::ControlInit {
            config: config.clone(),
            uid,
            epoch,
            inbox: control_rx,
            to_cores: to_cores.clone(),
            listener: cluster_listener,
            shared: shared.clone(),
            scope,
        };
        // The control executor shares the last core on small machines.
        let pin = (config.pin_cores && ncpu > 1).then_some(ncpu - 1);
        threads.push(
            crate::runtime::spawn_executor("shardline-control".into(), pin, move || {
                control::run(cinit)
            })
            .map_err(NodeError::Spawn)?,
        );
        drop(probe);
        drop(http_probe);
        let node = Node {
            config,
            uid,
            to_control,
            to_cores,
            shared,
            threads,
            _lock: lock,
            started_types: std::sync::Mutex::default(),
        };
        for t in node.config.entity_types.clone() {
            node.sharding().start(
                &t.name,
                crate::entity::builtin_factory_full(
                    t.kind,
                    t.snapshot_every,
                    crate::entity::supervision::SupervisorSettings::of_type(&t),
                    Some((
                        t.aggregate_target().to_string(),
                        Duration::from_millis(t.aggregate_interval_ms),
                    )),
                ),
                EntitySettings {
                    idle_timeout: NodeConfig::idle_timeout(&t),
                    active_entity_limit: (t.active_entity_limit > 0)
                        .then_some(t.active_entity_limit as usize),
                    remember_entities: t.remember_entities,
                    remember_entities_pace: crate::persistence::remember::pace(
                        t.remember_entities_per_s,
                    ),
                    stateless_worker: crate::entity::worker::WorkerSettings::of_type(&t),
                    ..EntitySettings::default()
                },
            )?;
        }
        Ok(node)
    }

    /// This node's configuration.
    pub fn config(&self) -> &NodeConfig {
        &self.config
    }

    /// This incarnation's uid.
    pub fn uid(&self) -> MemberUid {
        self.uid
    }

    /// Blocks until this member is Up, every core's journal opened (a
    /// core whose journal did not open keeps the node unready: this then
    /// ends in `NotReady`), and every region is registered with the
    /// coordinator and knows the home of every shard (warm routing;
    /// bounded by `coordinator.ready_warm_timeout_ms`, after which the node
    /// is ready anyway, see `docs/interfaces.md`).
    ///
    /// # Errors
    /// [`NodeError::NotReady`] after `timeout`, [`NodeError::Refused`] when it
    /// stopped instead of joining (see [`Self::refusal`]), [`NodeError::Stopped`].
    pub fn wait_ready(&self, timeout: Duration) -> Result<(), NodeError> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(reason) = self.refusal() {
                return Err(NodeError::Refused(reason));
            }
            if self.shared.stopped.load(Ordering::Acquire) != 0 {
                return Err(NodeError::Stopped);
            }
            if self.shared.ready.load(Ordering::Acquire) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(NodeError::NotReady(timeout))
    }

    /// This node's view of the cluster, as `shardline status` prints it
    /// (the native front's status request, `GET /v1/status`): the members
    /// and their states, the leader, where the coordinators run, the
    /// coordinators hosted here, and this node's regions on every data
    /// core with their shards and entities (Akka's `Cluster.state` and
    /// each region's `GetShardRegionState`).
    ///
    /// Waits at most `timeout` for the control executor and each data
    /// core; a data core that has not answered by then leaves its regions
    /// out.
    ///
    /// # Errors
    /// [`NodeError::Stopped`] when the node has stopped;
    /// [`NodeError::StatusTimedOut`] when the control executor did not
    /// answer within `timeout`.
    pub fn status(&self, timeout: Duration) -> Result<NodeStatus, NodeError> {
        let deadline = Instant::now() + timeout;
        let (cluster_tx, cluster_rx) = crossbeam_channel::bounded(1);
        self.to_control
            .send(ToControl::Status { reply: cluster_tx })
            .map_err(|_| NodeError::Stopped)?;
        let (cores_tx, cores_rx) = crossbeam_channel::bounded(self.to_cores.len().max(1));
        let asked = self
            .to_cores
            .iter()
            .filter(|c| {
                c.send(ToCore::Status {
                    reply: cores_tx.clone(),
                })
                .is_ok()
            })
            .count();
        drop(cores_tx);
        let view = cluster_rx.recv_deadline(deadline).map_err(|e| match e {
            crossbeam_channel::RecvTimeoutError::Timeout => NodeError::StatusTimedOut(timeout),
            crossbeam_channel::RecvTimeoutError::Disconnected => NodeError::Stopped,
        })?;
        let mut regions = Vec::new();
        for _ in 0..asked {
            match cores_rx.recv_deadline(deadline) {
                Ok(mut r) => regions.append(&mut r),
                Err(_) => break,
            }
        }
        let me = shardline_core::ids::UniqueAddress {
            address: shardline_core::ids::Address(self.config.cluster_address.to_string().into()),
            uid: self.uid,
        };
        Ok(admin::node_status(
            &me,
            self.config.client_address.to_string(),
            view,
            regions,
        ))
    }

    /// Whether the node stopped (left, or was downed).
    pub fn is_stopped(&self) -> bool {
        self.shared.stopped.load(Ordering::Acquire) != 0
    }

    /// Why this node stopped instead of joining, when it did: the cluster
    /// it reached is of another cluster name or id, or keeps durable state
    /// in journals this node cannot share (the reason names
    /// `journal.backend`).
    pub fn refusal(&self) -> Option<String> {
        if self.shared.stopped.load(Ordering::Acquire) != 4 {
            return None;
        }
        self.shared.refusal.lock().ok().and_then(|g| g.clone())
    }

    /// Whether this node was downed by the cluster (it stopped serving).
    pub fn was_downed(&self) -> bool {
        self.shared.stopped.load(Ordering::Acquire) == 2
    }

    /// Cluster sharding of this node.
    pub fn sharding(&self) -> Sharding<'_> {
        Sharding { node: self }
    }

    /// A reference to an entity anywhere in the cluster.
    ///
    /// # Errors
    /// [`IdError`] for an invalid type name or entity id.
    pub fn entity_ref(&self, type_name: &str, entity_id: &str) -> Result<EntityRef, IdError> {
        let t = TypeName::new(type_name)?;
        let id = EntityId::new(entity_id)?;
        let shard =
            shardline_core::sharding::shard_id_of(id.as_str(), self.config.number_of_shards);
        let core = shard.0 as usize % self.to_cores.len();
        Ok(EntityRef {
            type_name: t.as_str().into(),
            id,
            to_core: self.to_cores[core].clone(),
            ask_timeout: self.config.requests.ask_timeout(),
            max_message: self.config.requests.max_message_size_bytes,
        })
    }

    /// Subscribes to cluster events: the first is the current state, then
    /// every change. Dropping the receiver unsubscribes.
    pub fn subscribe(&self) -> crossbeam_channel::Receiver<ClusterEvent> {
        let (tx, rx) = crossbeam_channel::bounded(1024);
        if let Ok(mut s) = self.shared.subscribers.lock() {
            s.push(tx);
        }
        let _ = self.to_control.send(ToControl::Subscribe);
        rx
    }

    /// Leaves gracefully: hands off this node's shards, leaves the cluster,
    /// stops the executors. Returns when done or after `timeout`.
    pub fn leave(mut self, timeout: Duration) {
        let (tx, rx) = crossbeam_channel::bounded(1);
        if self
            .to_control
            .send(ToControl::Leave { timeout, done: tx })
            .is_ok()
        {
            let _ = rx.recv_timeout(timeout + Duration::from_secs(2));
        }
        self.stop_threads();
    }

    /// Waits (up to `timeout`) until the node stopped by itself (downed or
    /// left), then stops the executors.
    pub fn wait_stopped(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.is_stopped() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    fn stop_threads(&mut self) {
        let _ = self.to_control.send(ToControl::Shutdown);
        for c in &self.to_cores {
            let _ = c.send(ToCore::Shutdown);
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

/// What this node's handshakes carry and check: the sharding fingerprint,
/// the cluster name, the journal identity of its data root and whether it
/// hosts durable types (from its config).
pub(crate) fn fingerprint(
    config: &NodeConfig,
    scope: &crate::persistence::DataScope,
) -> crate::transport::Fingerprint {
    crate::transport::Fingerprint {
        hash_name: shardline_core::sharding::SHARD_ID_HASH_NAME.to_string(),
        number_of_shards: config.number_of_shards,
        cluster_name: config.cluster_name.clone(),
        journal_identity: scope.journal_identity(),
        durable: config.has_durable_types(),
    }
}

/// How long [`Node::start`] keeps retrying an address that is in use
/// (`EADDRINUSE`) before it fails with [`NodeError::Bind`]: 10 s.
///
/// A node restarted at once after a crash (`kill -9`, a supervisor's
/// immediate restart) can find its addresses still held for a few
/// milliseconds after the old process was reaped, longer on a loaded
/// machine: the old process's io_uring instances are torn down by a kernel
/// worker after the process exits, and the listening sockets stay open
/// (in `LISTEN`) until that worker has cancelled the requests that hold
/// them (a pending accept). A plain process without io_uring releases its
/// listeners before `waitpid` returns. Other bind errors (address not
/// available, permission denied) fail at once.
pub const BIND_RETRY_TIMEOUT: Duration = Duration::from_secs(10);

/// First pause between two bind attempts (doubling up to
/// [`BIND_RETRY_MAX_PAUSE`]).
const BIND_RETRY_FIRST_PAUSE: Duration = Duration::from_millis(5);
/// Longest pause between two bind attempts.
const BIND_RETRY_MAX_PAUSE: Duration = Duration::from_millis(500);

/// Runs `bind` until it succeeds, fails with an error other than
/// `AddrInUse`, or [`BIND_RETRY_TIMEOUT`] has passed; each failed attempt is
/// logged with the reason and the pause before the next.
///
/// # Errors
/// [`NodeError::Bind`] with the last error.
fn bind_with_retry<T>(
    what: &'static str,
    addr: std::net::SocketAddr,
    mut bind: impl FnMut() -> std::io::Result<T>,
) -> Result<T, NodeError> {
    let deadline = Instant::now() + BIND_RETRY_TIMEOUT;
    let mut pause = BIND_RETRY_FIRST_PAUSE;
    let mut attempt = 1u32;
    loop {
        match bind() {
            Ok(v) => {
                if attempt > 1 {
                    tracing::info!(what, %addr, attempt, "bound");
                }
                return Ok(v);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                let left = deadline.saturating_duration_since(Instant::now());
                let wait = pause.min(left);
                tracing::warn!(
                    what,
                    %addr,
                    attempt,
                    error = %e,
                    retry_in_ms = wait.as_millis() as u64,
                    "address in use; retrying (a process that just exited may still hold it)"
                );
                std::thread::sleep(wait);
                pause = (pause * 2).min(BIND_RETRY_MAX_PAUSE);
                attempt += 1;
            }
            Err(e) => {
                return Err(NodeError::Bind {
                    what,
                    addr,
                    source: e,
                })
            }
        }
    }
}

/// Checks that the address can be bound with SO_REUSEPORT (so the data
/// executors will succeed) and holds it until they did; the probe socket is
/// closed afterwards.
///
/// It first binds without SO_REUSEPORT: a listener left by a process that
/// just died (see [`BIND_RETRY_TIMEOUT`]) would otherwise share the port
/// with this node's listeners, and the kernel would hand it connections
/// that nobody accepts.
fn reuse_port_probe(addr: std::net::SocketAddr) -> std::io::Result<socket2::Socket> {
    let new = || {
        socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )
    };
    let exclusive = new()?;
    exclusive.set_reuse_address(true)?;
    exclusive.bind(&addr.into())?;
    drop(exclusive);
    let sock = new()?;
    sock.set_reuse_address(true)?;
    sock.set_reuse_port(true)?;
    sock.bind(&addr.into())?;
    sock.listen(1)?;
    Ok(sock)
}

/// Cluster sharding on a node: starts regions and proxies.
pub struct Sharding<'a> {
    node: &'a Node,
}

/// A handle to a started entity type.
#[derive(Debug, Clone)]
pub struct RegionHandle {
    type_name: TypeName,
}

impl RegionHandle {
    /// The entity type.
    pub fn type_name(&self) -> &TypeName {
        &self.type_name
    }
}

impl Sharding<'_> {
    /// Starts a region for `type_name` on every data core of this node,
    /// hosting entities made by `factory`.
    ///
    /// The entities run as `factory` makes them, without a supervisor
    /// (wrap the factory with [`crate::entity::supervision::supervised`]
    /// for restarts with backoff). A failure of one is confined to its
    /// incarnation: a handler's `Err`, and a panic in any of its calls on
    /// the data core (the factory, `on_start`, `handle`, `on_timer`,
    /// `on_durable`, `on_ask_reply`, `on_terminated`), which the core
    /// catches (`catch_unwind`) and logs at WARN (rate-limited), answer the
    /// message's sender `EntityFailed` at once and stop the incarnation
    /// (its state dropped, watchers told `Failed`); the next message starts
    /// a fresh one, and the core's other entities go on. A panic in
    /// `on_stop`, `on_stopping`, `may_stop_waiting` or the entity's `Drop`
    /// is caught and logged. In a binary built with `panic = "abort"`
    /// (not the engine's profiles) nothing can be caught: a panic aborts
    /// the process.
    ///
    /// # Errors
    /// [`NodeError::Stopped`]; an invalid type name is reported as
    /// [`NodeError::Config`]; [`NodeError::AlreadyStarted`] when the type
    /// is already started on this node (Akka's `ClusterSharding.start`
    /// hands back the existing region and ignores the new factory; this
    /// says so instead, since the new factory and settings would not be
    /// used).
    pub fn start(
        &self,
        type_name: &str,
        factory: EntityFactory,
        settings: EntitySettings,
    ) -> Result<RegionHandle, NodeError> {
        self.register(type_name, Some(factory), settings)
    }

    /// Starts `type_name` as a stateless worker on this node (Orleans
    /// `[StatelessWorker(maxLocalWorkers)]`): requests to it, from clients
    /// of this node or its embedding API, run on local activations made by
    /// `factory`, at most `worker.max_local_workers` on this node, collected
    /// after `settings.idle_timeout` idle. `settings.stateless_worker` is
    /// replaced by `worker`.
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_stateless_worker(
        &self,
        type_name: &str,
        factory: EntityFactory,
        worker: crate::entity::worker::WorkerSettings,
        settings: EntitySettings,
    ) -> Result<RegionHandle, NodeError> {
        let settings = EntitySettings {
            stateless_worker: Some(worker),
            ..settings
        };
        self.register(type_name, Some(factory), settings)
    }

    /// Starts a proxy for `type_name`: routes to the type's regions on other
    /// nodes, hosts nothing here.
    ///
    /// # Errors
    /// As [`Self::start`].
    pub fn start_proxy(&self, type_name: &str) -> Result<RegionHandle, NodeError> {
        self.register(type_name, None, EntitySettings::default())
    }

    fn register(
        &self,
        type_name: &str,
        factory: Option<EntityFactory>,
        settings: EntitySettings,
    ) -> Result<RegionHandle, NodeError> {
        let t = TypeName::new(type_name).map_err(|e| {
            NodeError::Config(crate::config::ConfigError::Invalid {
                file: "<embedded>".into(),
                key: "type_name".into(),
                reason: e.to_string(),
            })
        })?;
        let first = self
            .node
            .started_types
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(t.as_str().to_string());
        if !first {
            return Err(NodeError::AlreadyStarted(t.as_str().to_string()));
        }
        self.node
            .to_control
            .send(ToControl::RegisterType {
                type_name: t.as_str().to_string(),
                remember_entities: settings.remember_entities,
            })
            .map_err(|_| NodeError::Stopped)?;
        for c in &self.node.to_cores {
            c.send(ToCore::RegisterType {
                type_name: t.as_str().to_string(),
                factory: factory.clone(),
                settings: settings.clone(),
            })
            .map_err(|_| NodeError::Stopped)?;
        }
        Ok(RegionHandle { type_name: t })
    }
}

/// A reference to one entity; cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct EntityRef {
    /// The type name, shared by the messages of this reference (no
    /// allocation per message).
    type_name: std::sync::Arc<str>,
    id: EntityId,
    to_core: RingSender<ToCore>,
    /// `requests.ask_timeout_ms`.
    ask_timeout: Duration,
    /// `requests.max_message_size_bytes`: a longer message is not sent.
    max_message: u64,
}

impl EntityRef {
    /// The entity's id.
    pub fn id(&self) -> &EntityId {
        &self.id
    }

    /// Refuses a message longer than `requests.max_message_size_bytes`,
    /// the limit of the HTTP and native fronts and of the node-to-node
    /// wire: checked here, before anything is sent, so that its fate does
    /// not depend on where the entity's shard lives.
    fn check_size(&self, len: usize) -> Result<(), crate::api::NotSent> {
        let size = u64::try_from(len).unwrap_or(u64::MAX);
        if size > self.max_message {
            return Err(crate::api::NotSent::TooLarge {
                size,
                limit: self.max_message,
            });
        }
        Ok(())
    }

    /// Sends a message without waiting for a reply (at most once). Its ask
    /// deadline is `requests.ask_timeout_ms`: still buffered then (a shard
    /// home being resolved, a hand-off), it is dropped as a
    /// `deadline_passed` dead letter and never delivered later.
    ///
    /// A message longer than `requests.max_message_size_bytes` is refused
    /// before anything is sent, wherever the entity lives.
    ///
    /// # Errors
    /// [`AskError::Stopped`] when the node is gone, [`AskError::Failed`] with
    /// `BufferFull` when the core's inbox is full, [`AskError::Failed`] with
    /// [`Status::TooLarge`] for a message over the limit.
    pub fn tell(&self, message: &[u8]) -> Result<(), AskError> {
        if self.check_size(message.len()).is_err() {
            return Err(AskError::Failed(Status::TooLarge));
        }
        self.to_core
            .send(ToCore::Ask {
                type_name: self.type_name.clone(),
                entity: self.id.clone(),
                payload: message.to_vec(),
                timeout: None,
                reply: None,
            })
            .map_err(|e| match e {
                crate::runtime::RingSendError::Full(_) => AskError::Failed(Status::BufferFull),
                _ => AskError::Stopped,
            })
    }

    /// Sends a message and blocks until the entity's reply (a wrapper of
    /// [`Self::ask_async`] for plain threads; inside an async service use
    /// that instead, which does not hold a worker thread).
    ///
    /// The message's ask deadline is `timeout` from now, at most
    /// `requests.ask_timeout_ms` (the deadline of HTTP and native requests):
    /// a message still buffered at its deadline (a shard home being
    /// resolved, a hand-off, a recovery) is answered
    /// [`AskError::Failed`]`(`[`Status::Unavailable`]`)` — not delivered,
    /// safe to retry — and never delivered later. The call waits for the
    /// reply until `timeout`, and at least until 1 s
    /// ([`crate::config::ANSWER_GRACE_MS`]) after the deadline so that such
    /// an answer arrives first; without any answer by then it returns
    /// [`AskError::TimedOut`] (the message may have reached its entity).
    ///
    /// A message longer than `requests.max_message_size_bytes` is refused
    /// before anything is sent, wherever the entity lives (as the HTTP and
    /// native fronts refuse it: `413`, `TooLarge`).
    ///
    /// # Errors
    /// [`AskError::Failed`] with the status of a failed request (`BufferFull`
    /// when the core's inbox is full, `TooLarge` for a message over the
    /// limit), [`AskError::TimedOut`], [`AskError::Stopped`].
    pub fn ask(&self, message: &[u8], timeout: Duration) -> Result<Vec<u8>, AskError> {
        if self.check_size(message.len()).is_err() {
            return Err(AskError::Failed(Status::TooLarge));
        }
        let wait = self.wait_of(timeout);
        self.ask_async(message.to_vec(), timeout)
            .map_err(|e| match e.reason {
                crate::api::NotSent::InboxFull => AskError::Failed(Status::BufferFull),
                crate::api::NotSent::Stopped => AskError::Stopped,
                crate::api::NotSent::TooLarge { .. } => AskError::Failed(Status::TooLarge),
            })?
            .wait(wait)
    }

    /// Sends a message and returns a future of the entity's reply, usable
    /// on any executor (completed from the data core's thread; see
    /// [`crate::api`]). Deadline and wait as [`Self::ask`]: the future
    /// resolves at the latest at the wait, to [`AskError::TimedOut`], by
    /// the data core's tick (5 ms).
    ///
    /// Cancel safety: the message is sent by this call; dropping the
    /// future does not recall it (it is still delivered, at most once) and
    /// its reply is discarded.
    ///
    /// # Errors
    /// [`crate::api::SendError`] with the message when it was not sent
    /// (the core's inbox is full, the node stopped, or
    /// [`crate::api::NotSent::TooLarge`]: longer than
    /// `requests.max_message_size_bytes`, refused before sending wherever
    /// the entity lives).
    pub fn ask_async(
        &self,
        message: Vec<u8>,
        timeout: Duration,
    ) -> Result<crate::api::AskFuture, crate::api::SendError<Vec<u8>>> {
        self.send_ask(message, timeout)
            .map(crate::api::AskFuture::new)
    }

    /// How long an ask with `timeout` waits for its answer: `timeout`, and
    /// at least 1 s past its deadline.
    pub(crate) fn wait_of(&self, timeout: Duration) -> Duration {
        let deadline = timeout.min(self.ask_timeout);
        timeout.max(deadline + Duration::from_millis(crate::config::ANSWER_GRACE_MS))
    }

    /// The `requests.ask_timeout_ms` of the node.
    pub(crate) fn default_timeout(&self) -> Duration {
        self.ask_timeout
    }

    /// Sends an ask; the answer arrives on the returned receiver.
    pub(crate) fn send_ask(
        &self,
        message: Vec<u8>,
        timeout: Duration,
    ) -> Result<crate::api::oneshot::Receiver<ApiAnswer>, crate::api::SendError<Vec<u8>>> {
        if let Err(reason) = self.check_size(message.len()) {
            return Err(crate::api::SendError { message, reason });
        }
        let deadline = timeout.min(self.ask_timeout);
        let (tx, rx) = crate::api::oneshot::channel();
        self.to_core
            .send(ToCore::Ask {
                type_name: self.type_name.clone(),
                entity: self.id.clone(),
                payload: message,
                timeout: Some(deadline),
                reply: Some(msg::ApiReply {
                    tx,
                    wait: self.wait_of(timeout),
                }),
            })
            .map_err(|e| {
                let (reason, m) = match e {
                    crate::runtime::RingSendError::Full(m) => (crate::api::NotSent::InboxFull, m),
                    crate::runtime::RingSendError::Closed(m) => (crate::api::NotSent::Stopped, m),
                };
                let message = match m {
                    ToCore::Ask { payload, .. } => payload,
                    _ => Vec::new(),
                };
                crate::api::SendError { message, reason }
            })?;
        Ok(rx)
    }

    /// Sends a message without waiting for a reply, handing it back when
    /// it was not sent (see [`Self::tell`] for the deadline and the size
    /// limit).
    ///
    /// # Errors
    /// [`crate::api::SendError`] with the message (inbox full, node stopped,
    /// [`crate::api::NotSent::TooLarge`]).
    pub fn try_tell(&self, message: Vec<u8>) -> Result<(), crate::api::SendError<Vec<u8>>> {
        if let Err(reason) = self.check_size(message.len()) {
            return Err(crate::api::SendError { message, reason });
        }
        self.to_core
            .send(ToCore::Ask {
                type_name: self.type_name.clone(),
                entity: self.id.clone(),
                payload: message,
                timeout: None,
                reply: None,
            })
            .map_err(|e| {
                let (reason, m) = match e {
                    crate::runtime::RingSendError::Full(m) => (crate::api::NotSent::InboxFull, m),
                    crate::runtime::RingSendError::Closed(m) => (crate::api::NotSent::Stopped, m),
                };
                let message = match m {
                    ToCore::Ask { payload, .. } => payload,
                    _ => Vec::new(),
                };
                crate::api::SendError { message, reason }
            })
    }
}
