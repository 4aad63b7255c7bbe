//! The node configuration: the TOML file read by `shardline node --config
//! FILE` (format in `docs/interfaces.md`, "Node config"), parsed strictly:
//! an unknown key or a bad value is refused with the file, the key and the
//! reason.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use thiserror::Error;

mod builder;
mod cluster;
mod coordinator;
mod requests;
pub use builder::{NodeConfigBuilder, BUILDER_FILE};
pub use cluster::{ClusterTableConfig, OnJoinRefused};
pub use coordinator::CoordinatorConfig;
pub use requests::{
    RequestsConfig, ANSWER_GRACE_MS, DEFAULT_ASK_TIMEOUT_MS, ENVELOPE_OVERHEAD_BYTES,
    MAX_MESSAGE_SIZE_BYTES,
};

/// Errors from reading or checking a node configuration.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read: {source}")]
    Read {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TOML did not parse or did not match the schema (unknown key,
    /// wrong type); `reason` names the key.
    #[error("{file}: {reason}")]
    Parse {
        /// The file.
        file: PathBuf,
        /// What went wrong, with the key and its position.
        reason: String,
    },
    /// A value parsed but is not acceptable.
    #[error("{file}: key `{key}`: {reason}")]
    Invalid {
        /// The file (or `<embedded>` for a config built in code).
        file: PathBuf,
        /// The offending key.
        key: String,
        /// Why the value is refused.
        reason: String,
    },
}

/// Durability policy of the journal (entities in this release are not
/// persistent; the policy is validated and kept for the journal wiring).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Durability {
    /// `"none"` or `"always"`.
    Named(DurabilityName),
    /// `{ interval_ms = N }`: group commit every N milliseconds.
    Interval {
        /// Flush interval, in milliseconds.
        interval_ms: u64,
    },
}

/// The named durability policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DurabilityName {
    /// Never flush explicitly.
    None,
    /// Flush after every batch.
    Always,
}

/// Built-in entity kinds the node can host without user code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntityKind {
    /// Replies with the payload.
    Echo,
    /// `add <n>` / `get` on an i64.
    Counter,
    /// A pre-aggregating stateless worker: `add <key> <n>` / `get <key>`,
    /// partial sums forwarded to a `counter` type (`aggregate_to`).
    Aggregate,
}

impl EntityKind {
    /// Whether the kind runs as a stateless worker when its type does not
    /// say (`echo` and `aggregate` do, `counter` does not).
    pub fn worker_by_default(self) -> bool {
        matches!(self, EntityKind::Echo | EntityKind::Aggregate)
    }
}

/// One hosted entity type (`[[entity_types]]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntityTypeConfig {
    /// The type name clients address (1..=255 bytes, no `|`, not starting
    /// with `__`: see [`shardline_core::ids::TypeName`]).
    pub name: String,
    /// Which built-in implementation hosts it.
    pub kind: EntityKind,
    /// Idle passivation timeout, in milliseconds; 0 disables it. Default 120000.
    #[serde(default = "default_idle_timeout_ms")]
    pub idle_timeout_ms: u64,
    /// Maximum live entities of this type per region; 0 = unlimited (default).
    #[serde(default)]
    pub active_entity_limit: u32,
    /// Remember entities: started entities are recorded in the core's
    /// journal and started again, without a message, when their shard
    /// starts after a move or a restart. Default false.
    #[serde(default)]
    pub remember_entities: bool,
    /// Pace of restarting remembered entities, in entities per second per
    /// shard; 0 = all at once (default).
    #[serde(default)]
    pub remember_entities_per_s: u32,
    /// Events between two snapshots of a durable entity (count); 0 = never.
    /// Default 100.
    #[serde(default = "default_snapshot_every")]
    pub snapshot_every: u64,
    /// Run the type as a stateless worker (Orleans semantics: local
    /// activations, no routing; see `entity::worker`). Default: true for
    /// `echo` and `aggregate`, false for `counter` (which refuses true;
    /// `aggregate` refuses false).
    #[serde(default)]
    pub stateless_worker: Option<bool>,
    /// Most activations of a stateless worker type on this node (count);
    /// 0 = the node's `data_cores` (default).
    #[serde(default)]
    pub max_local_workers: u32,
    /// Most requests of a stateless worker type waiting per data core while
    /// every activation is busy (count); a full queue answers `BufferFull`.
    /// Default 10000.
    #[serde(default = "default_worker_queue_size")]
    pub worker_queue_size: u32,
    /// `aggregate` only: the entity type (kind `counter`, declared in the
    /// same file) that keeps the totals. Default `"aggregate_totals"`.
    #[serde(default)]
    pub aggregate_to: Option<String>,
    /// `aggregate` only: how often an activation sends its partial sums, in
    /// milliseconds (1..=3600000). Default 1000.
    #[serde(default = "default_aggregate_interval_ms")]
    pub aggregate_interval_ms: u64,
    /// Supervision: first restart delay after a failure, in milliseconds.
    /// Default 100. See [`crate::entity::supervision`].
    #[serde(default = "default_restart_min_backoff_ms")]
    pub restart_min_backoff_ms: u64,
    /// Supervision: largest restart delay, in milliseconds (at least
    /// `restart_min_backoff_ms`). Default 10000.
    #[serde(default = "default_restart_max_backoff_ms")]
    pub restart_max_backoff_ms: u64,
    /// Supervision: random extra delay as a fraction of the delay, in
    /// `0.0..=1.0`. Default 0.2.
    #[serde(default = "default_restart_random_factor")]
    pub restart_random_factor: f64,
    /// Supervision: most restarts within `restart_window_ms` (count); one
    /// more failure stops the entity. Default 10.
    #[serde(default = "default_max_restarts")]
    pub max_restarts: u32,
    /// Supervision: the window restarts are counted in, in milliseconds
    /// (at least 1). Default 60000.
    #[serde(default = "default_restart_window_ms")]
    pub restart_window_ms: u64,
}

impl EntityTypeConfig {
    /// A type named `name` of `kind` with every other key at its default.
    pub fn new(name: impl Into<String>, kind: EntityKind) -> Self {
        EntityTypeConfig {
            name: name.into(),
            kind,
            idle_timeout_ms: default_idle_timeout_ms(),
            active_entity_limit: 0,
            remember_entities: false,
            remember_entities_per_s: 0,
            snapshot_every: default_snapshot_every(),
            stateless_worker: None,
            max_local_workers: 0,
            worker_queue_size: default_worker_queue_size(),
            aggregate_to: None,
            aggregate_interval_ms: default_aggregate_interval_ms(),
            restart_min_backoff_ms: default_restart_min_backoff_ms(),
            restart_max_backoff_ms: default_restart_max_backoff_ms(),
            restart_random_factor: default_restart_random_factor(),
            max_restarts: default_max_restarts(),
            restart_window_ms: default_restart_window_ms(),
        }
    }

    /// Whether the type runs as a stateless worker.
    pub fn is_stateless_worker(&self) -> bool {
        self.stateless_worker
            .unwrap_or_else(|| self.kind.worker_by_default())
    }

    /// The target type of an `aggregate` kind (`aggregate_to`, or
    /// [`DEFAULT_AGGREGATE_TARGET_TYPE`]).
    pub fn aggregate_target(&self) -> &str {
        self.aggregate_to
            .as_deref()
            .unwrap_or(DEFAULT_AGGREGATE_TARGET_TYPE)
    }
}

/// The type an `aggregate` kind sends its partial sums to when the config
/// does not name one (`aggregate_to`).
pub const DEFAULT_AGGREGATE_TARGET_TYPE: &str = "aggregate_totals";

/// Default bound of a data core's stateless-worker queue
/// (`worker_queue_size`), in messages.
pub const DEFAULT_WORKER_QUEUE_SIZE: u32 = 10_000;

fn default_restart_min_backoff_ms() -> u64 {
    100
}
fn default_restart_max_backoff_ms() -> u64 {
    10_000
}
fn default_restart_random_factor() -> f64 {
    0.2
}
fn default_max_restarts() -> u32 {
    10
}
fn default_restart_window_ms() -> u64 {
    60_000
}
fn default_worker_queue_size() -> u32 {
    DEFAULT_WORKER_QUEUE_SIZE
}
fn default_aggregate_interval_ms() -> u64 {
    1000
}

fn default_snapshot_every() -> u64 {
    100
}

fn default_idle_timeout_ms() -> u64 {
    120_000
}
fn default_true() -> bool {
    true
}
fn default_data_cores() -> u16 {
    1
}
fn default_shards() -> u32 {
    100
}
/// Default of [`NodeConfig::cluster_name`].
pub const DEFAULT_CLUSTER_NAME: &str = "shardline";

fn default_cluster_name() -> String {
    DEFAULT_CLUSTER_NAME.to_string()
}
fn default_durability() -> Durability {
    Durability::Named(DurabilityName::None)
}

/// Whether listeners on `a` and `b` would share connections: the same port
/// (not 0, which the OS assigns apart) and the same address, or either one
/// a wildcard (`0.0.0.0`, `::`).
fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    // `::ffff:127.0.0.1` is 127.0.0.1.
    let (x, y) = (a.ip().to_canonical(), b.ip().to_canonical());
    a.port() == b.port() && a.port() != 0 && (x == y || x.is_unspecified() || y.is_unspecified())
}

/// What [`NodeConfig::fit_connection_limits`] lowered: the per-core
/// connection limits of both fronts, (configured, in force).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimitsFitted {
    /// The process's open file limit the limits were fitted to (count).
    pub open_files: u64,
    /// Descriptors the configured limits would need on all data cores
    /// (count).
    pub needed: u64,
    /// `requests.max_native_connections_per_core`: configured, in force.
    pub native: (u32, u32),
    /// `http.max_connections_per_core`: configured, in force (`None`
    /// without an `http_address`).
    pub http: Option<(u32, u32)>,
}

/// A node's configuration (the whole TOML file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// Node-to-node TCP address, `host:port`; this is the member's address.
    pub cluster_address: SocketAddr,
    /// Native client protocol address (every data core accepts on it with
    /// SO_REUSEPORT).
    pub client_address: SocketAddr,
    /// Optional HTTP/1.1 front (entity requests, admin API, health checks,
    /// metrics; see `gateway::http`), served by every data core with
    /// SO_REUSEPORT. Default: none.
    #[serde(default)]
    pub http_address: Option<SocketAddr>,
    /// Cluster addresses to join through; may include this node's own. A node
    /// whose own address is the first seed forms the cluster when no other
    /// seed answers; a single node lists only its own cluster address.
    /// Required: a node joins only through its seeds, so an empty list
    /// (the default when the key is missing) is refused.
    #[serde(default)]
    pub seed_nodes: Vec<SocketAddr>,
    /// Number of data executors (regions) on this node. Default 1.
    #[serde(default = "default_data_cores")]
    pub data_cores: u16,
    /// Pin executors to cores when the machine has them: data core `i` to
    /// CPU `i % cpus`. Nodes that share a machine would all pin to the same
    /// CPUs, so their configs set it false (`configs/cluster-3`). Default
    /// true.
    #[serde(default = "default_true")]
    pub pin_cores: bool,
    /// The cluster's name; every member must have the same one (checked at
    /// the handshake), and a `data_dir` records the name of the cluster
    /// that wrote it (a node of another name refuses to start on it).
    /// 1..=64 bytes of `A-Z a-z 0-9 . _ -`. Default `"shardline"`.
    #[serde(default = "default_cluster_name")]
    pub cluster_name: String,
    /// Directory for this node's files (journal, lock, identity). One
    /// running node per `data_dir` (locked); its parent is the data root,
    /// whose other `data_dir`s of the same cluster this node's journals
    /// read when shards move.
    pub data_dir: PathBuf,
    /// Number of shards; must agree across the cluster (checked in the
    /// handshake). Default 100.
    #[serde(default = "default_shards")]
    pub number_of_shards: u32,
    /// Journal durability policy. Default `"none"`.
    #[serde(default = "default_durability")]
    pub durability: Durability,
    /// Hosted entity types.
    #[serde(default)]
    pub entity_types: Vec<EntityTypeConfig>,
    /// Split-brain resolver: how long the set of unreachable members must
    /// stay unchanged before the resolver downs one side, in milliseconds.
    /// Default 20000 (Akka's `stable-after`). Optional, an addition to the
    /// documented format.
    #[serde(default = "default_stable_after_ms")]
    pub downing_stable_after_ms: u64,
    /// Failure detector: acceptable heartbeat pause, in milliseconds.
    /// Default 3000 (Akka's `acceptable-heartbeat-pause`). Optional.
    #[serde(default = "default_heartbeat_pause_ms")]
    pub heartbeat_pause_ms: u64,
    /// Limits and timeouts of the HTTP front (`[http]` table). Every key is
    /// optional; the defaults are those of [`HttpConfig::default`].
    #[serde(default)]
    pub http: HttpConfig,
    /// Where durable state is stored (the `[journal]` table). Every key is
    /// optional; the default is the local memory-mapped journal.
    #[serde(default)]
    pub journal: JournalConfig,
    /// Request deadlines and the message size limit (`[requests]` table;
    /// every key optional, defaults of [`RequestsConfig::default`]).
    #[serde(default)]
    pub requests: RequestsConfig,
    /// The coordinators' rebalance and hand-off timing (`[coordinator]`
    /// table; every key optional, defaults of
    /// [`CoordinatorConfig::default`]).
    #[serde(default)]
    pub coordinator: CoordinatorConfig,
    /// What the node does when the seeds refuse it (`[cluster]` table;
    /// every key optional, defaults of [`ClusterTableConfig::default`]).
    #[serde(default)]
    pub cluster: ClusterTableConfig,
}

/// Which journal backend stores durable state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JournalBackend {
    /// The memory-mapped, segmented per-core journals under `data_dir`
    /// (one machine, or a data root every node can read).
    #[default]
    Local,
    /// A PostgreSQL database shared by every node (`journal.url`); see
    /// `docs/persistence.md` and [`crate::persistence::pg`].
    Postgres,
}

/// The `[journal]` table: the journal backend and its limits.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JournalConfig {
    /// `"local"` (default) or `"postgres"`.
    pub backend: JournalBackend,
    /// `postgres` only: the connection URL,
    /// `postgres://user[:password]@host:port/database` (or the key=value
    /// form of libpq). Required with `backend = "postgres"`.
    pub url: Option<String>,
    /// `postgres` only: connections a node opens for recovery reads, shared
    /// by its data cores (count, 1..=64). Each data core also has one
    /// connection of its own for its group commits. Default 2.
    pub pool_size: u32,
    /// `postgres` only: most events in one transaction (count,
    /// 1..=100000); a turn that appended more commits them in several
    /// transactions, in order. Default 4096.
    pub batch_max_rows: u32,
    /// `postgres` only: most payload bytes in one transaction (bytes,
    /// 1 KiB..=256 MiB; a single larger event still goes alone). Default
    /// 8 MiB.
    pub batch_max_bytes: u64,
    /// `postgres` only: how long a connection attempt may take before the
    /// database counts as unavailable, in milliseconds (100..=60000).
    /// Default 2000.
    pub connect_timeout_ms: u64,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            backend: JournalBackend::Local,
            url: None,
            pool_size: 2,
            batch_max_rows: 4096,
            batch_max_bytes: 8 << 20,
            connect_timeout_ms: 2000,
        }
    }
}

impl JournalConfig {
    /// Checks value ranges; `bad(key, reason)` builds the error.
    fn validate(&self, bad: impl Fn(&str, String) -> ConfigError) -> Result<(), ConfigError> {
        let d = JournalConfig::default();
        if self.backend == JournalBackend::Local {
            // Keys the local journal would ignore are refused.
            if self.url.is_some() {
                return Err(bad(
                    "journal.url",
                    "only with journal.backend = \"postgres\"".into(),
                ));
            }
            for (key, set) in [
                ("journal.pool_size", self.pool_size != d.pool_size),
                (
                    "journal.batch_max_rows",
                    self.batch_max_rows != d.batch_max_rows,
                ),
                (
                    "journal.batch_max_bytes",
                    self.batch_max_bytes != d.batch_max_bytes,
                ),
                (
                    "journal.connect_timeout_ms",
                    self.connect_timeout_ms != d.connect_timeout_ms,
                ),
            ] {
                if set {
                    return Err(bad(key, "only with journal.backend = \"postgres\"".into()));
                }
            }
            return Ok(());
        }
        match self.url.as_deref() {
            None | Some("") => {
                return Err(bad(
                    "journal.url",
                    "required with journal.backend = \"postgres\"".into(),
                ))
            }
            Some(u) => {
                if let Err(e) = u.parse::<postgres::Config>() {
                    return Err(bad("journal.url", format!("not a PostgreSQL URL: {e}")));
                }
            }
        }
        if !(1..=64).contains(&self.pool_size) {
            return Err(bad(
                "journal.pool_size",
                format!("{} is not in 1..=64", self.pool_size),
            ));
        }
        if !(1..=100_000).contains(&self.batch_max_rows) {
            return Err(bad(
                "journal.batch_max_rows",
                format!("{} is not in 1..=100000", self.batch_max_rows),
            ));
        }
        if !(1024..=(256 << 20)).contains(&self.batch_max_bytes) {
            return Err(bad(
                "journal.batch_max_bytes",
                format!("{} is not in 1024..=268435456", self.batch_max_bytes),
            ));
        }
        if !(100..=60_000).contains(&self.connect_timeout_ms) {
            return Err(bad(
                "journal.connect_timeout_ms",
                format!("{} is not in 100..=60000", self.connect_timeout_ms),
            ));
        }
        Ok(())
    }
}

/// Limits and timeouts of the HTTP/1.1 front (the `[http]` table), applied
/// per connection by every data core (see `gateway::http::serve`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// Largest accepted request body (the issue's `max_body_size`), in
    /// bytes; a larger `Content-Length` is answered `413` as soon as the
    /// headers are read. Default 1 MiB (1048576); at least 1 and, with an
    /// `http_address`, at most `requests.max_message_size_bytes` (16 MiB
    /// less 1 KiB by default; not compared without an HTTP front).
    pub max_body_size_bytes: u64,
    /// Time allowed for a request's line and headers from its first byte,
    /// in milliseconds; when it passes the client gets `408` and the
    /// connection is closed. Default 5000; at least 10.
    pub header_timeout_ms: u64,
    /// Time allowed for a whole request (head and body) from its first
    /// byte, in milliseconds; else `408` and close. Default 15000; at least
    /// `header_timeout_ms`.
    pub body_timeout_ms: u64,
    /// An idle keep-alive connection (no partial request and no response
    /// owed) is closed after this long, in milliseconds. Default 60000; at
    /// least 10.
    pub idle_timeout_ms: u64,
    /// Most open HTTP connections per data core (count); more are answered
    /// `503` and closed. Default 10000; 1..=1000000.
    pub max_connections_per_core: u32,
}

/// Default of [`HttpConfig::max_body_size_bytes`]: 1 MiB.
pub const DEFAULT_HTTP_MAX_BODY_SIZE_BYTES: u64 = 1024 * 1024;
/// Upper bound of [`HttpConfig::max_body_size_bytes`]: 64 MiB (a body is
/// held in memory whole).
pub const MAX_HTTP_MAX_BODY_SIZE_BYTES: u64 = 64 * 1024 * 1024;

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            max_body_size_bytes: DEFAULT_HTTP_MAX_BODY_SIZE_BYTES,
            header_timeout_ms: 5_000,
            body_timeout_ms: 15_000,
            idle_timeout_ms: 60_000,
            max_connections_per_core: 10_000,
        }
    }
}

impl HttpConfig {
    /// [`Self::header_timeout_ms`] as a Duration.
    pub fn header_timeout(&self) -> Duration {
        Duration::from_millis(self.header_timeout_ms)
    }
    /// [`Self::body_timeout_ms`] as a Duration.
    pub fn body_timeout(&self) -> Duration {
        Duration::from_millis(self.body_timeout_ms)
    }
    /// [`Self::idle_timeout_ms`] as a Duration.
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }

    /// Checks value ranges; `bad(key, reason)` builds the error.
    fn validate(&self, bad: impl Fn(&str, String) -> ConfigError) -> Result<(), ConfigError> {
        if self.max_body_size_bytes == 0 || self.max_body_size_bytes > MAX_HTTP_MAX_BODY_SIZE_BYTES
        {
            return Err(bad(
                "http.max_body_size_bytes",
                format!(
                    "{} is not in 1..={MAX_HTTP_MAX_BODY_SIZE_BYTES}",
                    self.max_body_size_bytes
                ),
            ));
        }
        if self.header_timeout_ms < 10 {
            return Err(bad("http.header_timeout_ms", "must be at least 10".into()));
        }
        if self.body_timeout_ms < self.header_timeout_ms {
            return Err(bad(
                "http.body_timeout_ms",
                format!(
                    "{} is less than http.header_timeout_ms ({}); both count from the request's first byte",
                    self.body_timeout_ms, self.header_timeout_ms
                ),
            ));
        }
        if self.idle_timeout_ms < 10 {
            return Err(bad("http.idle_timeout_ms", "must be at least 10".into()));
        }
        if self.max_connections_per_core == 0 || self.max_connections_per_core > 1_000_000 {
            return Err(bad(
                "http.max_connections_per_core",
                format!("{} is not in 1..=1000000", self.max_connections_per_core),
            ));
        }
        Ok(())
    }
}

fn default_stable_after_ms() -> u64 {
    20_000
}
fn default_heartbeat_pause_ms() -> u64 {
    3_000
}

impl NodeConfig {
    /// Reads and validates a config file.
    ///
    /// # Errors
    /// [`ConfigError::Read`] when the file cannot be read,
    /// [`ConfigError::Parse`] for bad TOML or unknown keys,
    /// [`ConfigError::Invalid`] for values out of range.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: path.to_path_buf(),
            source,
        })?;
        Self::from_toml(&text, path)
    }

    /// Parses and validates TOML text; `file` is used in error messages.
    ///
    /// # Errors
    /// As [`Self::from_file`], without `Read`.
    pub fn from_toml(text: &str, file: &Path) -> Result<Self, ConfigError> {
        let cfg: NodeConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
            file: file.to_path_buf(),
            reason: e.to_string().trim_end().replace('\n', " "),
        })?;
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// Lowers the per-core connection limits of both fronts
    /// (`requests.max_native_connections_per_core`,
    /// `http.max_connections_per_core`, the latter only with an
    /// `http_address`) when all data cores at their limits would need more
    /// descriptors than `open_files` (the process's `RLIMIT_NOFILE`) leaves
    /// for connections, as redis lowers `maxclients` to its file limit.
    /// Without this, a connection flood would exhaust the descriptors before
    /// any limit refused it: `accept` would fail with `EMFILE`, and so would
    /// the journal's next segment file and the lanes to other members.
    ///
    /// A quarter of `open_files`, at least 256, stays for everything else
    /// (segment files, one per segment while it exists; lanes, listeners,
    /// io_uring instances). Both limits are scaled by the same factor, each
    /// at least 1. Returns what was changed, or `None` when the limits fit.
    pub fn fit_connection_limits(&mut self, open_files: u64) -> Option<ConnectionLimitsFitted> {
        let reserved = (open_files / 4).max(256);
        let budget = open_files.saturating_sub(reserved);
        let cores = u64::from(self.data_cores.max(1));
        let native = u64::from(self.requests.max_native_connections_per_core);
        let http = if self.http_address.is_some() {
            u64::from(self.http.max_connections_per_core)
        } else {
            0
        };
        let needed = cores * (native + http);
        if needed <= budget {
            return None;
        }
        let scale = |n: u64| u32::try_from((n * budget / needed).max(1)).unwrap_or(u32::MAX);
        let fitted = ConnectionLimitsFitted {
            open_files,
            needed,
            native: (self.requests.max_native_connections_per_core, scale(native)),
            http: (http > 0).then(|| (self.http.max_connections_per_core, scale(http))),
        };
        self.requests.max_native_connections_per_core = fitted.native.1;
        if let Some((_, h)) = fitted.http {
            self.http.max_connections_per_core = h;
        }
        Some(fitted)
    }

    /// Checks value ranges.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad key.
    pub fn validate(&self, file: &Path) -> Result<(), ConfigError> {
        let bad = |key: &str, reason: String| ConfigError::Invalid {
            file: file.to_path_buf(),
            key: key.to_string(),
            reason,
        };
        if self.data_cores == 0 || self.data_cores > 256 {
            return Err(bad(
                "data_cores",
                format!("{} is not in 1..=256", self.data_cores),
            ));
        }
        if self.number_of_shards == 0 || self.number_of_shards > 1_000_000 {
            return Err(bad(
                "number_of_shards",
                format!("{} is not in 1..=1000000", self.number_of_shards),
            ));
        }
        if self.cluster_name.is_empty()
            || self.cluster_name.len() > 64
            || !self
                .cluster_name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(bad(
                "cluster_name",
                format!(
                    "{:?} is not 1..=64 bytes of A-Z a-z 0-9 . _ -",
                    self.cluster_name
                ),
            ));
        }
        // The listeners bind with SO_REUSEPORT, so two of them on one port
        // would both bind, and the kernel would hand a connection to
        // whichever matches best: a wildcard address beside a specific one
        // on the same port would quietly send some clients to the wrong
        // front.
        if overlap(self.cluster_address, self.client_address) {
            return Err(bad(
                "client_address",
                format!(
                    "{} overlaps cluster_address {} (same port, and the same address or a wildcard one)",
                    self.client_address, self.cluster_address
                ),
            ));
        }
        if let Some(http) = self.http_address {
            for (other, key) in [
                (self.cluster_address, "cluster_address"),
                (self.client_address, "client_address"),
            ] {
                if overlap(http, other) {
                    return Err(bad(
                        "http_address",
                        format!(
                            "{http} overlaps {key} {other} (same port, and the same address or a wildcard one)"
                        ),
                    ));
                }
            }
        }
        // The node keeps its lock, identity, journals and coordinator state
        // in data_dir, and reads its siblings' journals beside it: it needs
        // a directory with a parent (the data root).
        if self.data_dir.as_os_str().is_empty() {
            return Err(bad("data_dir", "is empty".into()));
        }
        if self.data_dir.parent().is_none() {
            return Err(bad(
                "data_dir",
                format!(
                    "{} has no parent directory to be the data root; use a directory of its own, e.g. /var/lib/shardline/node-1",
                    self.data_dir.display()
                ),
            ));
        }
        if let Durability::Interval { interval_ms } = self.durability {
            if interval_ms == 0 {
                return Err(bad("durability.interval_ms", "must be at least 1".into()));
            }
        }
        if self.downing_stable_after_ms == 0 {
            return Err(bad("downing_stable_after_ms", "must be at least 1".into()));
        }
        if self.heartbeat_pause_ms < 100 {
            return Err(bad("heartbeat_pause_ms", "must be at least 100".into()));
        }
        self.http.validate(bad)?;
        self.journal.validate(bad)?;
        // The HTTP body limit bounds only a front that runs.
        let http_max_body = self.http_address.map(|_| self.http.max_body_size_bytes);
        self.requests.validate(http_max_body, bad)?;
        self.coordinator.validate(bad)?;
        self.cluster.validate(bad)?;
        let mut seen = std::collections::HashSet::new();
        for (i, t) in self.entity_types.iter().enumerate() {
            if let Err(e) = shardline_core::ids::TypeName::new(t.name.clone()) {
                return Err(bad(&format!("entity_types[{i}].name"), e.to_string()));
            }
            if !seen.insert(t.name.clone()) {
                return Err(bad(
                    &format!("entity_types[{i}].name"),
                    format!("type `{}` is declared twice", t.name),
                ));
            }
            let worker = t.is_stateless_worker();
            if worker && t.kind == EntityKind::Counter {
                return Err(bad(
                    &format!("entity_types[{i}].stateless_worker"),
                    "a counter keeps state per id and cannot be a stateless worker".into(),
                ));
            }
            if !worker && t.kind == EntityKind::Aggregate {
                return Err(bad(
                    &format!("entity_types[{i}].stateless_worker"),
                    "an aggregate is always a stateless worker".into(),
                ));
            }
            if !worker && t.max_local_workers > 0 {
                return Err(bad(
                    &format!("entity_types[{i}].max_local_workers"),
                    "only for stateless workers".into(),
                ));
            }
            // Keys the type would ignore are refused (a value other than
            // the default counts as set).
            if worker && t.remember_entities {
                return Err(bad(
                    &format!("entity_types[{i}].remember_entities"),
                    "a stateless worker has no addressable entities to remember".into(),
                ));
            }
            if !t.remember_entities && t.remember_entities_per_s > 0 {
                return Err(bad(
                    &format!("entity_types[{i}].remember_entities_per_s"),
                    "only with remember_entities = true".into(),
                ));
            }
            if t.max_local_workers > 65_536 {
                return Err(bad(
                    &format!("entity_types[{i}].max_local_workers"),
                    format!("{} is more than 65536", t.max_local_workers),
                ));
            }
            if t.worker_queue_size == 0 {
                return Err(bad(
                    &format!("entity_types[{i}].worker_queue_size"),
                    "must be at least 1".into(),
                ));
            }
            if !worker && t.worker_queue_size != default_worker_queue_size() {
                return Err(bad(
                    &format!("entity_types[{i}].worker_queue_size"),
                    "only for stateless workers".into(),
                ));
            }
            if t.kind != EntityKind::Counter && t.snapshot_every != default_snapshot_every() {
                return Err(bad(
                    &format!("entity_types[{i}].snapshot_every"),
                    "only for durable types (kind \"counter\")".into(),
                ));
            }
            if t.kind == EntityKind::Aggregate {
                if !(1..=3_600_000).contains(&t.aggregate_interval_ms) {
                    return Err(bad(
                        &format!("entity_types[{i}].aggregate_interval_ms"),
                        format!("{} is not in 1..=3600000", t.aggregate_interval_ms),
                    ));
                }
                let to = t.aggregate_target();
                if !self
                    .entity_types
                    .iter()
                    .any(|o| o.name == to && o.kind == EntityKind::Counter)
                {
                    return Err(bad(
                        &format!("entity_types[{i}].aggregate_to"),
                        format!("no entity type `{to}` of kind \"counter\" is declared"),
                    ));
                }
            } else if t.aggregate_to.is_some() {
                return Err(bad(
                    &format!("entity_types[{i}].aggregate_to"),
                    "only for kind \"aggregate\"".into(),
                ));
            }
            let key = |k: &str| format!("entity_types[{i}].{k}");
            // Bounded so that `Instant + delay` cannot overflow (one day).
            const MAX_DELAY_MS: u64 = 86_400_000;
            if t.restart_min_backoff_ms > MAX_DELAY_MS {
                return Err(bad(
                    &key("restart_min_backoff_ms"),
                    format!("{} is more than {MAX_DELAY_MS}", t.restart_min_backoff_ms),
                ));
            }
            if t.restart_max_backoff_ms > MAX_DELAY_MS {
                return Err(bad(
                    &key("restart_max_backoff_ms"),
                    format!("{} is more than {MAX_DELAY_MS}", t.restart_max_backoff_ms),
                ));
            }
            if t.restart_min_backoff_ms > t.restart_max_backoff_ms {
                return Err(bad(
                    &key("restart_max_backoff_ms"),
                    format!(
                        "{} is less than restart_min_backoff_ms ({})",
                        t.restart_max_backoff_ms, t.restart_min_backoff_ms
                    ),
                ));
            }
            if !(0.0..=1.0).contains(&t.restart_random_factor) {
                return Err(bad(
                    &key("restart_random_factor"),
                    format!("{} is not in 0.0..=1.0", t.restart_random_factor),
                ));
            }
            if t.restart_window_ms == 0 || t.restart_window_ms > MAX_DELAY_MS {
                return Err(bad(
                    &key("restart_window_ms"),
                    format!("{} is not in 1..={MAX_DELAY_MS}", t.restart_window_ms),
                ));
            }
        }
        // A node joins only through its seeds (there is no other way to
        // join): without any it would never become a member.
        if self.seed_nodes.is_empty() {
            return Err(bad(
                "seed_nodes",
                format!(
                    "is empty, so the node would never join a cluster: list the cluster addresses \
                     to join through, or only this node's own cluster address ([\"{}\"]) for a \
                     node that forms its own cluster",
                    self.cluster_address
                ),
            ));
        }
        Ok(())
    }

    /// Whether the node hosts durable entity types from its config (kind
    /// `counter`: event-sourced in the journal).
    pub fn has_durable_types(&self) -> bool {
        self.entity_types
            .iter()
            .any(|t| t.kind == EntityKind::Counter && !t.is_stateless_worker())
    }

    /// The idle timeout of an entity type as a Duration (None when disabled).
    pub fn idle_timeout(t: &EntityTypeConfig) -> Option<Duration> {
        (t.idle_timeout_ms > 0).then(|| Duration::from_millis(t.idle_timeout_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
cluster_address  = "127.0.0.1:7101"
client_address   = "127.0.0.1:7201"
seed_nodes       = ["127.0.0.1:7101"]
data_cores       = 1
pin_cores        = true
data_dir         = "/tmp/shardline/node-1"
number_of_shards = 100
durability       = { interval_ms = 1 }
[[entity_types]]
name = "counter"
kind = "counter"
idle_timeout_ms = 120000
active_entity_limit = 0
"#;

    #[test]
    fn parses_the_documented_example() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.entity_types[0].kind, EntityKind::Counter);
        assert_eq!(c.durability, Durability::Interval { interval_ms: 1 });
    }

    #[test]
    fn cluster_name_defaults_and_is_checked() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.cluster_name, DEFAULT_CLUSTER_NAME);
        assert!(c.has_durable_types());
        let c = NodeConfig::from_toml(
            &format!("cluster_name = \"orders-1\"\n{GOOD}"),
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.cluster_name, "orders-1");
        for bad in ["", "a b", "é", &"x".repeat(65)] {
            let e = NodeConfig::from_toml(
                &format!("cluster_name = {bad:?}\n{GOOD}"),
                Path::new("x.toml"),
            )
            .unwrap_err();
            assert!(e.to_string().contains("cluster_name"), "{bad}: {e}");
        }
    }

    #[test]
    fn connection_limits_are_fitted_to_the_open_file_limit() {
        let mut c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        let before = c.clone();
        // Plenty: nothing changes.
        assert_eq!(c.fit_connection_limits(1 << 20), None);
        assert_eq!(c, before);
        // systemd's default soft limit, one core, no HTTP front: a quarter
        // (256) stays for the rest, 768 for native connections.
        c.data_cores = 1;
        c.http_address = None;
        let f = c.fit_connection_limits(1024).expect("lowered");
        assert_eq!(f.needed, 10_000);
        assert_eq!(f.native, (10_000, 768));
        assert_eq!(f.http, None);
        assert_eq!(c.requests.max_native_connections_per_core, 768);
        // Two cores and both fronts share the budget by their configured
        // shares (native 3,000, HTTP 1,000 per core: 8,000 needed).
        let mut c = before.clone();
        c.data_cores = 2;
        c.http_address = Some("127.0.0.1:7301".parse().unwrap());
        c.requests.max_native_connections_per_core = 3_000;
        c.http.max_connections_per_core = 1_000;
        let f = c.fit_connection_limits(4_096).expect("lowered");
        assert_eq!(f.needed, 8_000);
        // 4096 - 1024 = 3072 for connections: 3/8 of it per core native.
        assert_eq!(f.native, (3_000, 1_152));
        assert_eq!(f.http, Some((1_000, 384)));
        // A limit below the reserve still leaves one connection of each.
        let mut c = before.clone();
        c.http_address = Some("127.0.0.1:7301".parse().unwrap());
        let f = c.fit_connection_limits(100).expect("lowered");
        assert_eq!((f.native.1, f.http.map(|h| h.1)), (1, Some(1)));
    }

    #[test]
    fn requests_table_defaults_ranges_and_one_size_limit() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.requests, RequestsConfig::default());
        assert_eq!(c.requests.ask_timeout(), Duration::from_secs(12));
        assert_eq!(c.requests.max_message_size_bytes, (16 << 20) - 1024);
        assert_eq!(c.requests.frame_timeout(), Duration::from_secs(15));
        assert_eq!(c.requests.max_native_connections_per_core, 10_000);
        assert_eq!(c.requests.send_timeout(), Duration::from_secs(60));
        let with = |t: &str| format!("{GOOD}\n[requests]\n{t}\n");
        let c = NodeConfig::from_toml(
            &with(
                "ask_timeout_ms = 1500\nmax_message_size_bytes = 2097152\nframe_timeout_ms = 700\nmax_native_connections_per_core = 3\nsend_timeout_ms = 250",
            ),
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.requests.ask_timeout_ms, 1500);
        assert_eq!(c.requests.frame_timeout_ms, 700);
        assert_eq!(c.requests.max_native_connections_per_core, 3);
        assert_eq!(c.requests.send_timeout_ms, 250);
        assert_eq!(c.requests.max_request_frame_bytes(), (2 << 20) + 1024);
        for (t, key) in [
            ("ask_timeout_ms = 5", "requests.ask_timeout_ms"),
            ("frame_timeout_ms = 99", "requests.frame_timeout_ms"),
            ("send_timeout_ms = 99", "requests.send_timeout_ms"),
            ("send_timeout_ms = 3600001", "requests.send_timeout_ms"),
            (
                "max_native_connections_per_core = 0",
                "requests.max_native_connections_per_core",
            ),
            (
                "max_native_connections_per_core = 1000001",
                "requests.max_native_connections_per_core",
            ),
            (
                "max_message_size_bytes = 0",
                "requests.max_message_size_bytes",
            ),
            (
                "max_message_size_bytes = 16777216",
                "requests.max_message_size_bytes",
            ),
        ] {
            let e = NodeConfig::from_toml(&with(t), Path::new("x.toml")).unwrap_err();
            assert!(e.to_string().contains(key), "{t}: {e}");
        }
    }

    #[test]
    fn the_http_body_limit_is_compared_with_the_message_limit_only_with_an_http_front() {
        let small = format!("{GOOD}\n[requests]\nmax_message_size_bytes = 1000\n");
        // No http_address: the HTTP default (1 MiB) bounds nothing.
        let c = NodeConfig::from_toml(&small, Path::new("x.toml")).unwrap();
        assert_eq!(c.requests.max_message_size_bytes, 1000);
        // With an HTTP front, the default 1 MiB body exceeds the limit.
        let with_http = format!("http_address = \"127.0.0.1:7301\"\n{small}");
        let e = NodeConfig::from_toml(&with_http, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("http.max_body_size_bytes"), "{e}");
        // ... and a body limit within it is accepted.
        let fits = with_http.replacen(
            "[requests]",
            "[http]\nmax_body_size_bytes = 1000\n[requests]",
            1,
        );
        let c = NodeConfig::from_toml(&fits, Path::new("x.toml")).unwrap();
        assert_eq!(c.http.max_body_size_bytes, 1000);
    }

    #[test]
    fn coordinator_table_defaults_and_ranges() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.coordinator, CoordinatorConfig::default());
        assert_eq!(c.coordinator.rebalance_interval(), Duration::from_secs(10));
        assert_eq!(c.coordinator.handoff_timeout(), Duration::from_secs(60));
        assert_eq!(c.coordinator.reregister_timeout(), Duration::from_secs(10));
        assert_eq!(c.coordinator.rebalance_absolute_limit, 20);
        let with = |t: &str| format!("{GOOD}\n[coordinator]\n{t}\n");
        let c = NodeConfig::from_toml(
            &with("rebalance_interval_ms = 500\nrebalance_absolute_limit = 100\nrebalance_relative_limit = 1.0"),
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.coordinator.rebalance_interval_ms, 500);
        assert_eq!(c.coordinator.rebalance_absolute_limit, 100);
        let c = NodeConfig::from_toml(&with("min_nr_of_members = 3"), Path::new("x.toml")).unwrap();
        assert_eq!(c.coordinator.min_nr_of_members, 3);
        for (t, key) in [
            (
                "rebalance_interval_ms = 50",
                "coordinator.rebalance_interval_ms",
            ),
            ("handoff_timeout_ms = 0", "coordinator.handoff_timeout_ms"),
            (
                "reregister_timeout_ms = 99",
                "coordinator.reregister_timeout_ms",
            ),
            (
                "rebalance_absolute_limit = 0",
                "coordinator.rebalance_absolute_limit",
            ),
            ("min_nr_of_members = 0", "coordinator.min_nr_of_members"),
            (
                "rebalance_relative_limit = 0.0",
                "coordinator.rebalance_relative_limit",
            ),
            (
                "rebalance_relative_limit = 1.5",
                "coordinator.rebalance_relative_limit",
            ),
            ("bogus = 1", "bogus"),
        ] {
            let e = NodeConfig::from_toml(&with(t), Path::new("x.toml")).unwrap_err();
            assert!(e.to_string().contains(key), "{t}: {e}");
        }
    }

    #[test]
    fn cluster_table_on_join_refused() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.cluster.on_join_refused, OnJoinRefused::Retry);
        let with = |t: &str| format!("{GOOD}\n[cluster]\n{t}\n");
        for (t, want) in [
            ("on_join_refused = \"exit\"", OnJoinRefused::Exit),
            ("on_join_refused = \"retry\"", OnJoinRefused::Retry),
        ] {
            let c = NodeConfig::from_toml(&with(t), Path::new("x.toml")).unwrap();
            assert_eq!(c.cluster.on_join_refused, want, "{t}");
        }
        assert_eq!(c.cluster.refusals_to_down, 3);
        assert_eq!(c.cluster.refusal_probe_interval_ms, 200);
        let c = NodeConfig::from_toml(
            &with("refusals_to_down = 0\nrefusal_probe_interval_ms = 50"),
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(
            (
                c.cluster.refusals_to_down,
                c.cluster.refusal_probe_interval_ms
            ),
            (0, 50)
        );
        for (t, key) in [
            ("on_join_refused = \"stop\"", "on_join_refused"),
            ("refusals_to_down = 101", "refusals_to_down"),
            ("refusal_probe_interval_ms = 5", "refusal_probe_interval_ms"),
            ("bogus = 1", "bogus"),
        ] {
            let e = NodeConfig::from_toml(&with(t), Path::new("x.toml")).unwrap_err();
            assert!(e.to_string().contains(key), "{t}: {e}");
        }
    }

    #[test]
    fn refuses_unknown_keys_naming_file_and_key() {
        let text = format!("{GOOD}\nbogus = 1\n");
        let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("x.toml") && msg.contains("bogus"), "{msg}");
    }

    #[test]
    fn worker_keys() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        assert!(crate::entity::worker::WorkerSettings::of_type(&c.entity_types[0]).is_none());
        let text = GOOD.replace(
            "active_entity_limit = 0",
            "active_entity_limit = 0\nstateless_worker = true",
        );
        let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("stateless_worker"), "{e}");
        let agg = format!(
            "{GOOD}\n[[entity_types]]\nname = \"agg\"\nkind = \"aggregate\"\naggregate_to = \"counter\"\nmax_local_workers = 3\naggregate_interval_ms = 20\n[[entity_types]]\nname = \"e\"\nkind = \"echo\"\n"
        );
        let c = NodeConfig::from_toml(&agg, Path::new("x.toml")).unwrap();
        let w = crate::entity::worker::WorkerSettings::of_type(&c.entity_types[1]).unwrap();
        assert_eq!(w.max_local_workers, Some(3));
        let w = crate::entity::worker::WorkerSettings::of_type(&c.entity_types[2]).unwrap();
        assert_eq!(w.max_local_workers, None);
        let e = NodeConfig::from_toml(
            &agg.replace("aggregate_to = \"counter\"", "aggregate_to = \"e\""),
            Path::new("x.toml"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("aggregate_to"), "{e}");
    }

    #[test]
    fn refuses_a_config_without_seed_nodes() {
        for text in [
            GOOD.replace("seed_nodes       = [\"127.0.0.1:7101\"]\n", ""),
            GOOD.replace("[\"127.0.0.1:7101\"]\ndata_cores", "[]\ndata_cores"),
        ] {
            let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("key `seed_nodes`") && msg.contains("[\"127.0.0.1:7101\"]"),
                "{msg}"
            );
        }
    }

    #[test]
    fn refuses_bad_values() {
        let text = GOOD.replace("data_cores       = 1", "data_cores = 0");
        let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("data_cores"), "{e}");
        let text = GOOD.replace("kind = \"counter\"", "kind = \"blob\"");
        assert!(NodeConfig::from_toml(&text, Path::new("x.toml")).is_err());
        let text = GOOD.replace(
            "durability       = { interval_ms = 1 }",
            "durability = \"sometimes\"",
        );
        assert!(NodeConfig::from_toml(&text, Path::new("x.toml")).is_err());
        // Addresses that collide, and data dirs without a data root.
        for (from, to, key) in [
            (
                "data_dir         = \"/tmp/shardline/node-1\"",
                "data_dir = \"\"",
                "data_dir",
            ),
            (
                "data_dir         = \"/tmp/shardline/node-1\"",
                "data_dir = \"/\"",
                "data_dir",
            ),
        ] {
            assert!(GOOD.contains(from), "{from}");
            let e =
                NodeConfig::from_toml(&GOOD.replace(from, to), Path::new("x.toml")).unwrap_err();
            assert!(e.to_string().contains(key), "{to}: {e}");
        }
        let client = GOOD
            .lines()
            .find(|l| l.starts_with("client_address"))
            .and_then(|l| l.split('"').nth(1))
            .expect("GOOD names a client_address");
        let text = format!("http_address = \"{client}\"\n{GOOD}");
        let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
        assert!(
            e.to_string().contains("http_address") && e.to_string().contains("overlaps"),
            "{e}"
        );
        // A wildcard address on the client port (SO_REUSEPORT would let both
        // bind, and split the clients between the fronts); another port of
        // the wildcard address is fine.
        let port = client.rsplit(':').next().expect("a port");
        let text = format!("http_address = \"0.0.0.0:{port}\"\n{GOOD}");
        let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
        assert!(
            e.to_string().contains("http_address") && e.to_string().contains("client_address"),
            "{e}"
        );
        let text = format!("http_address = \"0.0.0.0:1\"\n{GOOD}");
        NodeConfig::from_toml(&text, Path::new("x.toml")).expect("another port");
        // An IPv4-mapped IPv6 address is its IPv4 address.
        let text = format!("http_address = \"[::ffff:{client}\"\n{GOOD}").replacen(
            &format!("[::ffff:{client}"),
            &format!(
                "[::ffff:{}]:{port}",
                client.rsplit_once(':').expect("host:port").0
            ),
            1,
        );
        let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("overlaps"), "{text}: {e}");
        let wild = GOOD.replace(&format!("\"{client}\""), &format!("\"[::]:{port}\""));
        assert_ne!(wild, GOOD);
        let cluster = GOOD
            .lines()
            .find(|l| l.starts_with("cluster_address"))
            .and_then(|l| l.split('"').nth(1))
            .expect("GOOD names a cluster_address");
        let cport = cluster.rsplit(':').next().expect("a port");
        let text = wild.replace(&format!("\"{cluster}\""), &format!("\"127.0.0.1:{port}\""));
        let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
        assert!(e.to_string().contains("client_address"), "{e}");
        assert_ne!(cport, port);
        // Type names that could share a persistence id with another type.
        for name in ["a|b", "__shard"] {
            let text = format!("{GOOD}\n[[entity_types]]\nname = \"{name}\"\nkind = \"counter\"\n");
            let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
            assert!(e.to_string().contains("entity_types[1].name"), "{e}");
        }
    }

    #[test]
    fn refuses_keys_the_type_would_ignore_naming_the_key() {
        let echo = |keys: &str| {
            format!("{GOOD}\n[[entity_types]]\nname = \"e\"\nkind = \"echo\"\n{keys}\n")
        };
        let counter =
            |keys: &str| GOOD.replace("kind = \"counter\"", &format!("kind = \"counter\"\n{keys}"));
        for (text, key) in [
            (echo("remember_entities = true"), "remember_entities"),
            (echo("snapshot_every = 5"), "snapshot_every"),
            (echo("worker_queue_size = 0"), "worker_queue_size"),
            (echo("max_local_workers = 100000000"), "max_local_workers"),
            (counter("worker_queue_size = 5"), "worker_queue_size"),
            (
                counter("remember_entities_per_s = 10"),
                "remember_entities_per_s",
            ),
        ] {
            let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
            assert!(e.to_string().contains(&format!("].{key}")), "{key}: {e}");
        }
        // The same keys where they mean something are accepted.
        for text in [
            echo("worker_queue_size = 5\nmax_local_workers = 4"),
            counter("snapshot_every = 5\nremember_entities = true\nremember_entities_per_s = 10"),
        ] {
            NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap();
        }
    }

    /// `GOOD` with an `[http]` table inserted before the entity types.
    fn with_http(table: &str) -> String {
        GOOD.replace(
            "[[entity_types]]",
            &format!("[http]\n{table}\n[[entity_types]]"),
        )
    }

    #[test]
    fn http_table_defaults_and_overrides() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.http, HttpConfig::default());
        assert_eq!(c.http.max_body_size_bytes, 1024 * 1024);
        let c = NodeConfig::from_toml(
            &with_http("max_body_size_bytes = 16\nheader_timeout_ms = 300"),
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.http.max_body_size_bytes, 16);
        assert_eq!(c.http.header_timeout(), Duration::from_millis(300));
        assert_eq!(c.http.body_timeout_ms, 15_000);
        assert_eq!(c.http.max_connections_per_core, 10_000);
    }

    #[test]
    fn http_table_is_strict_and_validated() {
        for (table, key) in [
            ("max_body_size = 5", "max_body_size"),
            ("max_body_size_bytes = 0", "http.max_body_size_bytes"),
            ("max_body_size_bytes = 67108865", "http.max_body_size_bytes"),
            ("header_timeout_ms = 5", "http.header_timeout_ms"),
            (
                "header_timeout_ms = 2000\nbody_timeout_ms = 1000",
                "http.body_timeout_ms",
            ),
            ("idle_timeout_ms = 0", "http.idle_timeout_ms"),
            (
                "max_connections_per_core = 0",
                "http.max_connections_per_core",
            ),
            ("header_timeout_ms = -1", "header_timeout_ms"),
        ] {
            let e = NodeConfig::from_toml(&with_http(table), Path::new("x.toml")).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains(key) && msg.contains("x.toml"),
                "{table}: {msg}"
            );
        }
    }

    #[test]
    fn the_shipped_postgres_configs_parse() {
        for (name, text) in [
            (
                "node-1",
                include_str!("../../../configs/cluster-pg/node-1.toml"),
            ),
            (
                "node-2",
                include_str!("../../../configs/cluster-pg/node-2.toml"),
            ),
            (
                "node-3",
                include_str!("../../../configs/cluster-pg/node-3.toml"),
            ),
        ] {
            let c = NodeConfig::from_toml(text, Path::new(name)).expect(name);
            assert_eq!(c.journal.backend, JournalBackend::Postgres, "{name}");
        }
    }

    #[test]
    fn journal_table_defaults_and_validation() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        assert_eq!(c.journal, JournalConfig::default());
        assert_eq!(c.journal.backend, JournalBackend::Local);
        let with = |t: &str| {
            GOOD.replace(
                "[[entity_types]]",
                &format!("[journal]\n{t}\n[[entity_types]]"),
            )
        };
        let c = NodeConfig::from_toml(
            &with(
                "backend = \"postgres\"\nurl = \"postgres://u@127.0.0.1:5432/db\"\npool_size = 3",
            ),
            Path::new("x.toml"),
        )
        .unwrap();
        assert_eq!(c.journal.backend, JournalBackend::Postgres);
        assert_eq!(c.journal.pool_size, 3);
        assert_eq!(c.journal.batch_max_rows, 4096);
        for (table, key) in [
            ("backend = \"postgres\"", "journal.url"),
            ("backend = \"sqlite\"", "backend"),
            ("url = \"postgres://u@h/db\"", "journal.url"),
            ("pool_size = 4", "journal.pool_size"),
            (
                "backend = \"postgres\"\nurl = \"postgres://u@h/db\"\npool_size = 0",
                "journal.pool_size",
            ),
            (
                "backend = \"postgres\"\nurl = \"postgres://u@h/db\"\nbatch_max_rows = 0",
                "journal.batch_max_rows",
            ),
            (
                "backend = \"postgres\"\nurl = \"postgres://u@h/db\"\nbatch_max_bytes = 10",
                "journal.batch_max_bytes",
            ),
            (
                "backend = \"postgres\"\nurl = \"postgres://u@h/db\"\nconnect_timeout_ms = 1",
                "journal.connect_timeout_ms",
            ),
            (
                "backend = \"postgres\"\nurl = \"postgres://u@h:notaport/db\"",
                "journal.url",
            ),
            ("bogus = 1", "bogus"),
        ] {
            let e = NodeConfig::from_toml(&with(table), Path::new("x.toml")).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains(key) && msg.contains("x.toml"),
                "{table}: {msg}"
            );
        }
    }

    #[test]
    fn supervision_keys_default_and_parse() {
        let c = NodeConfig::from_toml(GOOD, Path::new("x.toml")).unwrap();
        let mut t = EntityTypeConfig::new("counter", EntityKind::Counter);
        t.idle_timeout_ms = 120_000;
        assert_eq!(c.entity_types[0], t, "new() has the TOML defaults");
        assert_eq!(
            crate::entity::supervision::SupervisorSettings::of_type(&c.entity_types[0]),
            crate::entity::supervision::SupervisorSettings::default()
        );
        let text = format!(
            "{GOOD}restart_min_backoff_ms = 5\nrestart_max_backoff_ms = 50\n\
             restart_random_factor = 0.5\nmax_restarts = 3\nrestart_window_ms = 1000\n"
        );
        let c = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap();
        let s = crate::entity::supervision::SupervisorSettings::of_type(&c.entity_types[0]);
        assert_eq!(s.min_backoff, Duration::from_millis(5));
        assert_eq!(s.max_backoff, Duration::from_millis(50));
        assert_eq!(s.random_factor, 0.5);
        assert_eq!(s.max_restarts, 3);
        assert_eq!(s.window, Duration::from_secs(1));
    }

    #[test]
    fn refuses_bad_supervision_values_naming_the_key() {
        let cases = [
            (
                "restart_min_backoff_ms = 500\nrestart_max_backoff_ms = 100\n",
                "entity_types[0].restart_max_backoff_ms",
            ),
            (
                "restart_random_factor = 1.5\n",
                "entity_types[0].restart_random_factor",
            ),
            (
                "restart_random_factor = -0.1\n",
                "entity_types[0].restart_random_factor",
            ),
            (
                "restart_random_factor = nan\n",
                "entity_types[0].restart_random_factor",
            ),
            (
                "restart_window_ms = 0\n",
                "entity_types[0].restart_window_ms",
            ),
            (
                "restart_min_backoff_ms = 100000000000\nrestart_max_backoff_ms = 100000000000\n",
                "entity_types[0].restart_min_backoff_ms",
            ),
            ("max_restarts = -1\n", "max_restarts"),
        ];
        for (extra, key) in cases {
            let text = format!("{GOOD}{extra}");
            let e = NodeConfig::from_toml(&text, Path::new("x.toml")).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("x.toml") && msg.contains(key),
                "{extra}: {msg}"
            );
        }
    }
}
