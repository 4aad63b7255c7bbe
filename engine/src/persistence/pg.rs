//! The PostgreSQL journal backend (`[journal] backend = "postgres"`).
//!
//! Durable entities' events and snapshots and the remember-entities
//! records live in one PostgreSQL database shared by every node of the
//! cluster, so a shard that moves to another machine recovers what its
//! previous home wrote (Akka's JDBC journal, Orleans' ADO.NET storage play
//! the same part). Schema: [`SCHEMA_SQL`], version [`SCHEMA_VERSION`];
//! documented in `docs/persistence.md`.
//!
//! Threads: no database I/O happens on a data or control executor. Each
//! data core has one writer thread with a connection of its own
//! ([`PgLog`]); a node has [`crate::config::JournalConfig::pool_size`]
//! reader threads for recovery reads. A core hands the appends of one
//! executor turn to its writer as one batch; the writer merges every batch
//! queued meanwhile into one statement (one round trip, one transaction:
//! group commit) and then wakes the core through its
//! [`DurableWake`]. An event counts as durable (its handler runs, its
//! command is answered) only once that statement committed.
//!
//! Fencing: a recovery claims the persistence id. In one transaction it
//! records its writer epoch in `shardline_writers` (refused when a newer
//! one is recorded) and inserts [`CLAIM_ROWS`] *claim rows* into
//! `shardline_events` at the next free sequence numbers (`claim = true`,
//! no payload); then it reads. An incarnation appends only the sequence
//! number after its last durable one (or after its last claim row), so
//! every older incarnation's next append collides with a claim row, or
//! with the newer incarnation's events, on the primary key
//! `(persistence_id, sequence_nr)`: the database refuses it in the
//! statement that would write it (a unique violation, reported as fenced),
//! with no extra lookup in the append. An older append that committed
//! before the claim is in what the recovery reads (the claim rows go after
//! it: a claim row that collides with an append in flight waits for it and
//! skips its number when it committed). The primary key is also the fence
//! of Akka's JDBC journal; the claim rows make the newest claim win.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use postgres::error::SqlState;
use postgres::{Client, NoTls};
use shardline_journal::{Lsn, PersistenceId, SequenceNr, WriterEpoch};

use super::{DurableWake, EventLog, LogError, RecoverStart, Recovered};
use crate::config::JournalConfig;

/// The schema version this build writes and reads. A database whose
/// recorded version is higher is refused (a newer release migrated it); a
/// lower one is migrated (version 2 added `shardline_clusters`, version 3
/// the claim rows' `claim` column).
pub const SCHEMA_VERSION: i32 = 3;

/// The schema, created at first start (idempotent; run under an advisory
/// lock so that nodes starting together do not race).
pub const SCHEMA_SQL: &str = "
CREATE TABLE IF NOT EXISTS shardline_schema (
    id int PRIMARY KEY CHECK (id = 1),
    version int NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS shardline_writers (
    persistence_id text PRIMARY KEY,
    writer_epoch bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS shardline_events (
    persistence_id text NOT NULL,
    sequence_nr bigint NOT NULL,
    writer_epoch bigint NOT NULL,
    payload bytea NOT NULL,
    claim boolean NOT NULL DEFAULT false,
    PRIMARY KEY (persistence_id, sequence_nr)
);
ALTER TABLE shardline_events ADD COLUMN IF NOT EXISTS claim boolean NOT NULL DEFAULT false;
CREATE TABLE IF NOT EXISTS shardline_snapshots (
    persistence_id text PRIMARY KEY,
    sequence_nr bigint NOT NULL,
    writer_epoch bigint NOT NULL,
    data bytea NOT NULL
);
CREATE TABLE IF NOT EXISTS shardline_clusters (
    cluster_name text PRIMARY KEY,
    cluster_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
";

/// The key of the advisory lock held while the schema is created.
const SCHEMA_LOCK_KEY: i64 = 0x5348_4152_444c_494e; // "SHARDLIN"

/// The group-commit statement: the events and snapshots of one batch;
/// returns the number of events inserted (a data-modifying `WITH` runs
/// whether or not the outer query reads it).
///
/// `$1..$4` are the events, `$5..$8` the snapshots (at most one per id),
/// both sorted by persistence id (bytewise) and sequence number: every
/// key lock of the statement is taken in that order, so two statements
/// sharing keys wait for each other instead of deadlocking.
///
/// The fence is the events' primary key (see the module doc): an event
/// whose sequence number is taken (by a newer incarnation's claim rows or
/// events) fails the whole statement with a unique violation, and the
/// writer retries the batch's ids in halves to refuse only that id's
/// rows. A snapshot replaces the stored one only when it is newer; an
/// older incarnation's snapshot covers only events that were durable, so
/// it is a snapshot of the same history the newer one recovered.
pub(crate) const APPEND_SQL: &str = "
WITH e AS (
    INSERT INTO shardline_events (persistence_id, sequence_nr, writer_epoch, payload)
    SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::bytea[])
    RETURNING 1
), s AS (
    INSERT INTO shardline_snapshots AS cur (persistence_id, sequence_nr, writer_epoch, data)
    SELECT * FROM unnest($5::text[], $6::int8[], $7::int8[], $8::bytea[])
    ON CONFLICT (persistence_id) DO UPDATE
        SET sequence_nr = EXCLUDED.sequence_nr, writer_epoch = EXCLUDED.writer_epoch,
            data = EXCLUDED.data
        WHERE cur.sequence_nr < EXCLUDED.sequence_nr
)
SELECT count(*) FROM e";

/// The recovery's claim: the id's writer epoch becomes ours unless a newer
/// one is recorded; returns the recorded epoch when it is ours.
const CLAIM_SQL: &str = "
INSERT INTO shardline_writers AS cur (persistence_id, writer_epoch) VALUES ($1, $2)
ON CONFLICT (persistence_id) DO UPDATE SET writer_epoch = EXCLUDED.writer_epoch
    WHERE cur.writer_epoch <= EXCLUDED.writer_epoch
RETURNING writer_epoch";

/// The claim rows: the id's next [`CLAIM_ROWS`] sequence numbers, taken
/// by the claiming epoch (after its [`CLAIM_SQL`], in the same
/// transaction) in ascending order, skipping the numbers an older
/// incarnation's appends in flight took first (`ON CONFLICT DO NOTHING`
/// waits for such an insert and then skips its number). Returns the
/// numbers taken.
const CLAIM_ROWS_SQL: &str = "
INSERT INTO shardline_events (persistence_id, sequence_nr, writer_epoch, payload, claim)
SELECT $1, n, $2, ''::bytea, true
FROM (SELECT greatest(coalesce(max(e.sequence_nr), 0),
                      coalesce((SELECT sequence_nr FROM shardline_snapshots
                                WHERE persistence_id = $1), 0)) AS m
      FROM shardline_events AS e WHERE e.persistence_id = $1) AS top,
     generate_series(top.m + 1, top.m + $3) AS n
ORDER BY n
ON CONFLICT DO NOTHING
RETURNING sequence_nr";

/// Sequence numbers a claim takes (count). An older incarnation appends
/// its numbers in ascending order, one statement at a time per writer;
/// the claim's insert walks its numbers within one statement (a few us
/// per number) while the older one needs a round trip through its node
/// for its next statement (100 us or more), so after the numbers of the
/// statement in flight the claim takes the rest, and the older one's next
/// append collides with them. With one number per claim, an older
/// incarnation appending back to back took the number before every
/// retry of the claim (measured: 50 retries lost in a row).
pub const CLAIM_ROWS: u64 = 8;

/// How often a claim is tried again when appends in flight took all of
/// its numbers (each retry reads above them).
const CLAIM_ATTEMPTS: usize = 50;

/// Settings of the backend, from the `[journal]` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgSettings {
    /// Connection URL (`postgres://user@host:port/db` or libpq key=value).
    pub url: String,
    /// Reader connections for recovery reads per node (count, >= 1).
    pub pool_size: u32,
    /// Most events per statement (count, >= 1).
    pub batch_max_rows: u32,
    /// Most payload bytes per statement (bytes).
    pub batch_max_bytes: u64,
    /// Connection attempt timeout.
    pub connect_timeout: Duration,
}

impl PgSettings {
    /// The settings of a `[journal]` table (`None` unless the backend is
    /// `postgres` with a URL).
    pub fn from_config(c: &JournalConfig) -> Option<PgSettings> {
        if c.backend != crate::config::JournalBackend::Postgres {
            return None;
        }
        Some(PgSettings {
            url: c.url.clone()?,
            pool_size: c.pool_size.max(1),
            batch_max_rows: c.batch_max_rows.max(1),
            batch_max_bytes: c.batch_max_bytes.max(1),
            connect_timeout: Duration::from_millis(c.connect_timeout_ms.max(1)),
        })
    }
}

/// Why the database refused or could not do something.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PgError {
    /// The database cannot be reached or went away (connection refused or
    /// lost, server shutting down); retried on the next use.
    #[error("journal unavailable: {0}")]
    Unavailable(String),
    /// The database's schema is newer than this build's.
    #[error(
        "journal schema version {found} is newer than this build's {supported}; upgrade the node"
    )]
    SchemaTooNew {
        /// Version recorded in `shardline_schema`.
        found: i32,
        /// [`SCHEMA_VERSION`].
        supported: i32,
    },
    /// A newer writer epoch is recorded for the persistence id.
    #[error("persistence id {pid}: writer epoch {epoch} is fenced by a newer incarnation")]
    Fenced {
        /// The persistence id.
        pid: String,
        /// The refused epoch.
        epoch: u64,
    },
    /// Any other refusal (constraint violation, bad data).
    #[error("journal: {0}")]
    Rejected(String),
}

impl PgError {
    pub(crate) fn classify(e: &postgres::Error) -> PgError {
        match e.as_db_error() {
            None => PgError::Unavailable(e.to_string()),
            Some(db) => {
                let code = db.code().code();
                let transient = code.starts_with("08")
                    || code.starts_with("53")
                    || code.starts_with("57P")
                    || *db.code() == SqlState::T_R_SERIALIZATION_FAILURE
                    || *db.code() == SqlState::T_R_DEADLOCK_DETECTED;
                if transient {
                    PgError::Unavailable(format!("{}: {}", code, db.message()))
                } else {
                    PgError::Rejected(format!("{}: {}", code, db.message()))
                }
            }
        }
    }

    fn to_log(&self) -> LogError {
        match self {
            PgError::Unavailable(_) => LogError::unavailable(self.to_string()),
            PgError::Fenced { .. } => LogError::fenced(self.to_string()),
            _ => LogError::failed(self.to_string()),
        }
    }
}

/// Opens a connection and makes sure the schema exists and is not newer
/// than [`SCHEMA_VERSION`].
///
/// # Errors
/// [`PgError::Unavailable`] when the database cannot be reached,
/// [`PgError::SchemaTooNew`], or [`PgError::Rejected`] when the schema
/// cannot be created (e.g. no privilege).
pub fn connect(settings: &PgSettings) -> Result<Client, PgError> {
    let mut cfg: postgres::Config = settings
        .url
        .parse()
        .map_err(|e: postgres::Error| PgError::Rejected(format!("bad journal.url: {e}")))?;
    cfg.connect_timeout(settings.connect_timeout);
    cfg.application_name("shardline");
    // The statements are prepared once and their plans do not depend on
    // the values: never plan them again per execution (a custom plan of
    // the journal's statements costs more than running them). Added in
    // front of the url's own `options` (e.g. a `search_path`), which are
    // kept and may set it otherwise.
    let options = match cfg.get_options() {
        Some(own) if !own.trim().is_empty() => {
            format!("-c plan_cache_mode=force_generic_plan {own}")
        }
        _ => "-c plan_cache_mode=force_generic_plan".to_string(),
    };
    cfg.options(&options);
    let mut client = cfg
        .connect(NoTls)
        .map_err(|e| PgError::Unavailable(e.to_string()))?;
    ensure_schema(&mut client)?;
    Ok(client)
}

fn ensure_schema(client: &mut Client) -> Result<(), PgError> {
    let err = |e: postgres::Error| PgError::classify(&e);
    let mut tx = client.transaction().map_err(err)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK_KEY])
        .map_err(err)?;
    tx.batch_execute(SCHEMA_SQL).map_err(err)?;
    tx.execute(
        "INSERT INTO shardline_schema (id, version) VALUES (1, $1) ON CONFLICT (id) DO NOTHING",
        &[&SCHEMA_VERSION],
    )
    .map_err(err)?;
    // Older schemas are migrated by the `IF NOT EXISTS` statements above.
    tx.execute(
        "UPDATE shardline_schema SET version = $1 WHERE id = 1 AND version < $1",
        &[&SCHEMA_VERSION],
    )
    .map_err(err)?;
    let found: i32 = tx
        .query_one("SELECT version FROM shardline_schema WHERE id = 1", &[])
        .map_err(err)?
        .get(0);
    tx.commit().map_err(err)?;
    if found > SCHEMA_VERSION {
        return Err(PgError::SchemaTooNew {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    Ok(())
}

/// The database's identity: `postgres:{system_identifier}/{database}`
/// (`system_identifier` from `pg_control_system()`, unique per
/// `initdb`), for the cluster's sharding fingerprint. When the role may
/// not call `pg_control_system()` the identifier part is the server's
/// address and port instead.
///
/// # Errors
/// [`PgError::Unavailable`] when the database cannot be reached.
pub fn identity(settings: &PgSettings) -> Result<String, PgError> {
    let mut client = connect(settings)?;
    let db: String = client
        .query_one("SELECT current_database()", &[])
        .map_err(|e| PgError::classify(&e))?
        .get(0);
    let sys = match client.query_one(
        "SELECT system_identifier::text FROM pg_control_system()",
        &[],
    ) {
        Ok(r) => r.get::<_, String>(0),
        Err(_) => {
            let r = client
                .query_one(
                    "SELECT coalesce(inet_server_addr()::text, 'local') || ':' || \
                     coalesce(inet_server_port()::text, '')",
                    &[],
                )
                .map_err(|e| PgError::classify(&e))?;
            r.get::<_, String>(0)
        }
    };
    Ok(format!("postgres:{sys}/{db}"))
}

/// Reads one persistence id after claiming it with `epoch`: records the
/// epoch and the claim rows (one transaction, see the module doc), then
/// reads the latest snapshot newer than `after_seq` and the events after
/// it (an indexed range read on the primary key; claim rows are left out
/// of the events and their sequence numbers count as taken).
/// [`Recovered::highest`] is the last claim row's sequence number: the
/// incarnation's first event is the one after it. `check_gaps`: refuse a
/// gap in the sequence numbers.
///
/// # Errors
/// [`PgError::Fenced`] when a newer epoch is recorded for the id;
/// [`PgError::Unavailable`] (also when appends in flight took the claim
/// rows' sequence numbers 50 (`CLAIM_ATTEMPTS`) times in a row);
/// [`PgError::Rejected`] on a gap.
pub fn claim_and_read(
    client: &mut Client,
    pid: &str,
    epoch: u64,
    after_seq: u64,
    check_gaps: bool,
) -> Result<Recovered, PgError> {
    let err = |e: postgres::Error| PgError::classify(&e);
    let ep = epoch as i64;
    let mut claim_row = None;
    for _ in 0..CLAIM_ATTEMPTS {
        // Dropping the transaction without commit rolls it back.
        let mut tx = client.transaction().map_err(err)?;
        let claimed = tx.query(CLAIM_SQL, &[&pid, &ep]).map_err(err)?;
        if claimed.is_empty() {
            return Err(PgError::Fenced {
                pid: pid.to_string(),
                epoch,
            });
        }
        let mut taken: Vec<i64> = tx
            .query(CLAIM_ROWS_SQL, &[&pid, &ep, &(CLAIM_ROWS as i64)])
            .map_err(err)?
            .iter()
            .map(|r| r.get::<_, i64>(0))
            .collect();
        taken.sort_unstable();
        // The older incarnation's numbers are below the claim's: a run of
        // numbers up to the highest one asked for. Anything else (every
        // number taken by appends in flight) is tried again above them.
        if !taken.is_empty() && taken.windows(2).all(|w| w[1] == w[0] + 1) {
            tx.commit().map_err(err)?;
            claim_row = taken.last().map(|n| *n as u64);
            break;
        }
        drop(tx);
    }
    let Some(highest) = claim_row else {
        return Err(PgError::Unavailable(format!(
            "cannot claim {pid}: appends in flight took its next sequence numbers {CLAIM_ATTEMPTS} times"
        )));
    };
    let snap = client
        .query_opt(
            "SELECT sequence_nr, data FROM shardline_snapshots \
             WHERE persistence_id = $1 AND sequence_nr > $2",
            &[&pid, &(after_seq as i64)],
        )
        .map_err(err)?
        .map(|r| (r.get::<_, i64>(0) as u64, r.get::<_, Vec<u8>>(1)));
    let from = snap.as_ref().map_or(after_seq, |s| s.0);
    let rows = client
        .query(
            "SELECT sequence_nr, payload, claim FROM shardline_events \
             WHERE persistence_id = $1 AND sequence_nr > $2 ORDER BY sequence_nr",
            &[&pid, &(from as i64)],
        )
        .map_err(err)?;
    if check_gaps {
        super::check_history(from, rows.iter().map(|r| r.get::<_, i64>(0) as u64), 0)
            .map_err(|e| PgError::Rejected(format!("events of {pid} are {e}")))?;
    }
    let mut events = Vec::with_capacity(rows.len());
    for r in &rows {
        if !r.get::<_, bool>(2) {
            events.push((r.get::<_, i64>(0) as u64, r.get::<_, Vec<u8>>(1)));
        }
    }
    Ok(Recovered {
        snapshot: snap,
        events,
        highest,
    })
}

/// One event of a batch.
#[derive(Debug, Clone)]
struct Row {
    lsn: u64,
    pid: String,
    seq: u64,
    epoch: u64,
    payload: Vec<u8>,
}

/// One snapshot of a batch (rides with the next events' statement).
#[derive(Debug, Clone)]
struct SnapRow {
    lsn: u64,
    pid: String,
    seq: u64,
    epoch: u64,
    data: Vec<u8>,
}

#[derive(Default)]
struct Batch {
    rows: Vec<Row>,
    snaps: Vec<SnapRow>,
    /// Highest LSN in the batch.
    last: u64,
}

/// Appends of one or more ids that were refused: `(lowest LSN, highest
/// LSN, why)` per id.
type Rejections = HashMap<String, Vec<(u64, u64, LogError)>>;

/// The refusals a core has not yet seen, under one lock with what the
/// writer needs to order them against the core's appends.
#[derive(Default)]
struct RejectState {
    /// Refused appends not yet reported to their entity.
    entries: Rejections,
    /// The highest LSN assigned on the core.
    assigned: u64,
    /// Per id recovered since: refusals of rows below this LSN belong to
    /// an incarnation state the recovery replaced and are not reported.
    floors: HashMap<String, u64>,
}

/// Finished recovery reads by ticket.
type ReadResults = HashMap<u64, Result<Recovered, LogError>>;

/// State shared between a core's [`PgLog`] and its writer and the readers.
struct CoreShared {
    /// Every LSN up to this one has an outcome (committed or refused).
    resolved: AtomicU64,
    /// Refused appends not yet seen by their entity, and the highest LSN
    /// assigned on the core (under the same lock: see [`PgLog::append`]).
    rejected: Mutex<RejectState>,
    /// Finished recovery reads by ticket.
    recovered: Mutex<(ReadResults, HashSet<u64>)>,
    /// The core's wake (set when the log is installed).
    wake: Mutex<Option<Arc<DurableWake>>>,
    /// For [`EventLog::wait_durable`].
    cond: Condvar,
    cond_lock: Mutex<()>,
}

impl CoreShared {
    fn notify(&self) {
        if let Ok(w) = self.wake.lock() {
            if let Some(w) = w.as_ref() {
                w.notify();
            }
        }
        let _g = self.cond_lock.lock();
        self.cond.notify_all();
    }
}

/// A recovery read for the reader pool.
struct ReadRequest {
    ticket: u64,
    pid: String,
    epoch: u64,
    after_seq: u64,
    check_gaps: bool,
    done: ReadDone,
}

enum ReadDone {
    Core(Arc<CoreShared>),
    Blocking(crossbeam_channel::Sender<Result<Recovered, LogError>>),
}

/// The node-wide part of the backend: settings, reader pool, health.
pub struct PgJournal {
    settings: PgSettings,
    reads: crossbeam_channel::Sender<ReadRequest>,
    /// Why the database is unusable now (`None`: the last use worked).
    health: Arc<Mutex<Option<String>>>,
}

impl PgJournal {
    /// Starts the backend for `settings`: the reader pool threads
    /// (`pg-read-{i}`, `settings.pool_size` of them; they exit when the
    /// last handle is dropped). The node makes one and hands it to each
    /// core's [`PgLog::open`]. No connection is made until a read needs
    /// one.
    pub fn new(settings: &PgSettings) -> Arc<PgJournal> {
        Arc::new(PgJournal::start(settings.clone()))
    }

    fn start(settings: PgSettings) -> PgJournal {
        let (tx, rx) = crossbeam_channel::bounded::<ReadRequest>(65_536);
        let health = Arc::new(Mutex::new(None));
        for i in 0..settings.pool_size {
            let rx = rx.clone();
            let s = settings.clone();
            let h = health.clone();
            let _ = std::thread::Builder::new()
                .name(format!("pg-read-{i}"))
                .spawn(move || reader_loop(&s, &rx, &h));
        }
        PgJournal {
            settings,
            reads: tx,
            health,
        }
    }

    /// Why the database is unusable now, if it is (the last error of a
    /// read or a commit; cleared by the next one that works).
    pub fn health(&self) -> Option<String> {
        self.health.lock().ok().and_then(|h| h.clone())
    }

    /// The database's identity (see [`identity`]).
    ///
    /// # Errors
    /// [`PgError::Unavailable`] when the database cannot be reached.
    pub fn identity(&self) -> Result<String, PgError> {
        identity(&self.settings)
    }

    /// The settings.
    pub fn settings(&self) -> &PgSettings {
        &self.settings
    }
}

fn set_health(h: &Mutex<Option<String>>, v: Option<String>) {
    if let Ok(mut g) = h.lock() {
        if *g != v {
            match &v {
                Some(why) => tracing::warn!(error = %why, "journal database unavailable"),
                None => tracing::info!("journal database available again"),
            }
            *g = v;
        }
    }
}

fn reader_loop(
    settings: &PgSettings,
    rx: &crossbeam_channel::Receiver<ReadRequest>,
    health: &Mutex<Option<String>>,
) {
    let mut client: Option<Client> = None;
    while let Ok(req) = rx.recv() {
        let res = (|| {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = Some(connect(settings)?);
            }
            let c = client
                .as_mut()
                .ok_or_else(|| PgError::Unavailable("no connection".into()))?;
            claim_and_read(c, &req.pid, req.epoch, req.after_seq, req.check_gaps)
        })();
        match &res {
            Err(PgError::Unavailable(why)) => {
                client = None;
                set_health(health, Some(format!("journal unavailable: {why}")));
            }
            Err(PgError::SchemaTooNew { .. }) => {
                client = None;
                set_health(health, res.as_ref().err().map(|e| e.to_string()));
            }
            _ => set_health(health, None),
        }
        let res = res.map_err(|e| e.to_log());
        match req.done {
            ReadDone::Core(shared) => {
                if let Ok(mut g) = shared.recovered.lock() {
                    let (done, forgotten) = &mut *g;
                    if !forgotten.remove(&req.ticket) {
                        done.insert(req.ticket, res);
                    }
                }
                shared.notify();
            }
            ReadDone::Blocking(tx) => {
                let _ = tx.send(res);
            }
        }
    }
}

/// One data core's journal on PostgreSQL, as an [`EventLog`].
///
/// LSNs are this core's own counter (1, 2, ...); [`EventLog::durable_lsn`]
/// is the highest LSN whose batch has an outcome, and
/// [`EventLog::rejected`] says which of them were refused.
pub struct PgLog {
    journal: Arc<PgJournal>,
    shared: Arc<CoreShared>,
    writes: Option<crossbeam_channel::Sender<Batch>>,
    writer: Option<std::thread::JoinHandle<()>>,
    pending: Batch,
    next_lsn: u64,
    next_ticket: u64,
    /// Highest sequence number per id appended or recovered here.
    highest: HashMap<String, u64>,
    /// Wakes the core's flush task (set by [`PgLog::set_flush_wake`]).
    flush_wake: Option<Arc<DurableWake>>,
}

impl PgLog {
    /// Core `index`'s log on the node's backend `journal` (see
    /// [`PgJournal::new`]: its reader pool and health are shared by the
    /// node's cores); starts the core's writer thread (named
    /// `pg-write-{index}`). No connection is made until the first write.
    pub fn open(journal: &Arc<PgJournal>, index: u16) -> PgLog {
        let journal = journal.clone();
        let shared = Arc::new(CoreShared {
            resolved: AtomicU64::new(0),
            rejected: Mutex::new(RejectState::default()),
            recovered: Mutex::new((HashMap::new(), HashSet::new())),
            wake: Mutex::new(None),
            cond: Condvar::new(),
            cond_lock: Mutex::new(()),
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Batch>();
        let s = journal.settings.clone();
        let sh = shared.clone();
        let health = journal.health.clone();
        let writer = std::thread::Builder::new()
            .name(format!("pg-write-{index}"))
            .spawn(move || writer_loop(&s, &rx, &sh, &health))
            .ok();
        PgLog {
            journal,
            shared,
            writes: Some(tx),
            writer,
            pending: Batch::default(),
            next_lsn: 1,
            next_ticket: 1,
            highest: HashMap::new(),
            flush_wake: None,
        }
    }

    /// The node-wide backend (health, identity).
    pub fn backend(&self) -> &Arc<PgJournal> {
        &self.journal
    }

    /// The core's durability wake: notified after every batch's outcome
    /// and every finished recovery read.
    pub fn set_core_wake(&self, wake: Arc<DurableWake>) {
        if let Ok(mut w) = self.shared.wake.lock() {
            *w = Some(wake);
        }
    }

    /// The wake of the core's flush task, notified on the first append of
    /// a turn (the task runs after the turn's other ready tasks and calls
    /// [`EventLog::flush`]). Without one, every append is sent at once.
    pub fn set_flush_wake(&mut self, wake: Arc<DurableWake>) {
        self.flush_wake = Some(wake);
    }

    fn push(&mut self) {
        if self.pending.rows.is_empty() && self.pending.snaps.is_empty() {
            return;
        }
        let b = std::mem::take(&mut self.pending);
        if let Some(tx) = &self.writes {
            let _ = tx.send(b);
        }
    }

    fn assign_lsn(&mut self, pid: &str) -> Result<u64, LogError> {
        let lsn = self.next_lsn;
        let mut g = self
            .shared
            .rejected
            .lock()
            .map_err(|_| LogError::failed("journal lock poisoned".into()))?;
        if let Some(v) = g.entries.get(pid) {
            if let Some((_, _, e)) = v.first() {
                return Err(e.clone());
            }
        }
        g.assigned = lsn;
        drop(g);
        self.next_lsn += 1;
        Ok(lsn)
    }

    fn schedule_flush(&mut self) {
        match &self.flush_wake {
            Some(w) => w.notify(),
            None => self.push(),
        }
    }
}

impl Drop for PgLog {
    fn drop(&mut self) {
        self.push();
        self.writes = None;
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
    }
}

fn is_remember(pid: &str) -> bool {
    pid.starts_with("__shard|")
}

impl EventLog for PgLog {
    fn append(
        &mut self,
        pid: &PersistenceId,
        seq: SequenceNr,
        epoch: WriterEpoch,
        payload: &[u8],
    ) -> Result<Lsn, String> {
        let lsn = self.assign_lsn(pid.as_str()).map_err(|e| e.message)?;
        self.highest
            .entry(pid.as_str().to_string())
            .and_modify(|h| *h = (*h).max(seq.0))
            .or_insert(seq.0);
        self.pending.rows.push(Row {
            lsn,
            pid: pid.as_str().to_string(),
            seq: seq.0,
            epoch: epoch.0,
            payload: payload.to_vec(),
        });
        self.pending.last = lsn;
        self.schedule_flush();
        Ok(Lsn(lsn))
    }

    fn recover(&mut self, pid: &PersistenceId, epoch: WriterEpoch) -> Result<Recovered, String> {
        // Blocking read for callers off the data cores (tests, tools): the
        // cores use `recover_start`. Waits for a reader thread, bounded.
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.forget_rejections(pid.as_str());
        let req = ReadRequest {
            ticket: 0,
            pid: pid.as_str().to_string(),
            epoch: epoch.0,
            after_seq: 0,
            check_gaps: !is_remember(pid.as_str()),
            done: ReadDone::Blocking(tx),
        };
        self.journal
            .reads
            .try_send(req)
            .map_err(|_| "journal unavailable: recovery queue full".to_string())?;
        let wait = self.journal.settings.connect_timeout * 3 + Duration::from_secs(5);
        let r = rx
            .recv_timeout(wait)
            .map_err(|_| "journal unavailable: recovery read timed out".to_string())?
            .map_err(|e| e.message)?;
        self.note_recovered(pid.as_str(), &r);
        Ok(r)
    }

    fn recover_start(
        &mut self,
        pid: &PersistenceId,
        epoch: WriterEpoch,
        after_seq: u64,
    ) -> RecoverStart {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.forget_rejections(pid.as_str());
        let req = ReadRequest {
            ticket,
            pid: pid.as_str().to_string(),
            epoch: epoch.0,
            after_seq,
            check_gaps: !is_remember(pid.as_str()),
            done: ReadDone::Core(self.shared.clone()),
        };
        match self.journal.reads.try_send(req) {
            Ok(()) => RecoverStart::Pending(ticket),
            Err(_) => RecoverStart::Ready(Err(LogError::unavailable(
                "journal unavailable: recovery queue full".into(),
            ))),
        }
    }

    fn recover_poll(
        &mut self,
        pid: &PersistenceId,
        ticket: u64,
    ) -> Option<Result<Recovered, LogError>> {
        let r = self.shared.recovered.lock().ok()?.0.remove(&ticket)?;
        if let Ok(rec) = &r {
            self.note_recovered(pid.as_str(), rec);
        }
        Some(r)
    }

    fn recover_forget(&mut self, ticket: u64) {
        if let Ok(mut g) = self.shared.recovered.lock() {
            let (done, forgotten) = &mut *g;
            if done.remove(&ticket).is_none() {
                forgotten.insert(ticket);
            }
        }
    }

    fn save_snapshot(
        &mut self,
        pid: &PersistenceId,
        seq: SequenceNr,
        epoch: WriterEpoch,
        data: &[u8],
    ) -> Result<(), String> {
        let lsn = self.assign_lsn(pid.as_str()).map_err(|e| e.message)?;
        self.pending.snaps.push(SnapRow {
            lsn,
            pid: pid.as_str().to_string(),
            seq: seq.0,
            epoch: epoch.0,
            data: data.to_vec(),
        });
        self.pending.last = lsn;
        self.schedule_flush();
        Ok(())
    }

    fn durable_lsn(&self) -> Lsn {
        Lsn(self.shared.resolved.load(Ordering::SeqCst))
    }

    fn highest_sequence_nr(&self, pid: &PersistenceId) -> u64 {
        self.highest.get(pid.as_str()).copied().unwrap_or(0)
    }

    fn wait_durable(&mut self, lsn: Lsn) -> Result<(), String> {
        self.push();
        let deadline =
            Instant::now() + self.journal.settings.connect_timeout * 3 + Duration::from_secs(5);
        let mut g = self
            .shared
            .cond_lock
            .lock()
            .map_err(|_| "journal lock poisoned")?;
        while self.shared.resolved.load(Ordering::SeqCst) < lsn.0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("journal unavailable: commit timed out".into());
            }
            g = self
                .shared
                .cond
                .wait_timeout(g, left.min(Duration::from_millis(50)))
                .map_err(|_| "journal lock poisoned")?
                .0;
        }
        Ok(())
    }

    fn rejected(&mut self, pid: &PersistenceId, lsn: Lsn) -> Option<LogError> {
        let g = self.shared.rejected.lock().ok()?;
        let v = g.entries.get(pid.as_str())?;
        // The entry stays until the id's next recovery: its appends are
        // refused meanwhile (see `assign_lsn`).
        v.iter()
            .find(|(lo, hi, _)| *lo <= lsn.0 && lsn.0 <= *hi)
            .map(|(_, _, e)| e.clone())
    }

    fn flush(&mut self) {
        self.push();
    }

    fn self_notifying(&self) -> bool {
        true
    }

    fn health(&self) -> Option<String> {
        self.journal.health()
    }
}

impl PgLog {
    fn forget_rejections(&mut self, pid: &str) {
        if let Ok(mut g) = self.shared.rejected.lock() {
            g.entries.remove(pid);
            g.floors.insert(pid.to_string(), self.next_lsn);
        }
    }

    fn note_recovered(&mut self, pid: &str, r: &Recovered) {
        let last = r
            .events
            .last()
            .map(|e| e.0)
            .or(r.snapshot.as_ref().map(|s| s.0))
            .unwrap_or(0)
            .max(r.highest);
        let h = self.highest.entry(pid.to_string()).or_insert(0);
        *h = (*h).max(last);
    }
}

/// The longest a writer holds a statement back to gather the appends its
/// previous commit's replies bring (see the writer thread's loop, `writer_loop`).
pub const GATHER_MAX: Duration = Duration::from_millis(2);

/// The gathering ends when all but `1 / GATHER_SLACK_DIV` of the previous
/// statement's rows came: the last few commands' next appends come late
/// (behind another turn of the core), and waiting for them cost the rest
/// of the window (measured at depth 64: 40 % of the statements waited it
/// out, 560-760 us of gathering per statement; with the slack 0-4 % and
/// 80-360 us).
pub const GATHER_SLACK_DIV: usize = 8;

/// A writer gathers only after a statement that took at least this long:
/// when commits are faster than the clients' round trip, waiting for their
/// next appends idles the database for longer than a second statement
/// costs (measured: half the adds/s at depth 64 with the database on
/// tmpfs).
pub const GATHER_FROM: Duration = Duration::from_millis(1);

/// Rows (events and snapshots) in a batch (count).
fn batch_len(b: &Batch) -> usize {
    b.rows.len() + b.snaps.len()
}

/// Appends `more` to `batch` (both in LSN order, `more` later).
fn merge(batch: &mut Batch, more: Batch) {
    batch.rows.extend(more.rows);
    batch.snaps.extend(more.snaps);
    batch.last = batch.last.max(more.last);
}

/// The writer thread of one core: merges the queued batches, commits them
/// in statements of at most `batch_max_rows` events / `batch_max_bytes`,
/// records refusals, moves `resolved` and wakes the core.
///
/// Adaptive group commit (MySQL's `binlog_group_commit_sync_delay` with
/// `..._no_delay_count`): the batches queued while a statement ran are
/// taken before the core is woken; the commit's replies then bring the
/// clients' next appends, so the writer waits for as many new rows as the
/// commit carried (less [`GATHER_SLACK_DIV`]'s share), at most the commit's own duration and at most
/// [`GATHER_MAX`], before it sends the next statement (only after a
/// statement that took [`GATHER_FROM`] or longer). Without that wait,
/// a closed loop of D requests splits into two halves that alternate
/// (each commit carries D/2 rows and every row waits for two commits);
/// with it they merge into one statement. A commit of one row waits for
/// nothing: the next row is sent the moment it comes.
fn writer_loop(
    settings: &PgSettings,
    rx: &crossbeam_channel::Receiver<Batch>,
    shared: &CoreShared,
    health: &Mutex<Option<String>>,
) {
    let mut client: Conn = None;
    // Ids whose earlier append was refused, with the highest LSN assigned
    // on the core at that moment: their rows up to it are refused too (a
    // later row would leave a gap in the sequence numbers).
    let mut poisoned: HashMap<String, u64> = HashMap::new();
    // Queued while the previous statement ran (taken before its wake).
    let mut carried: Option<Batch> = None;
    // Rows of the previous statement and the end of its gathering window.
    let mut gather: Option<(usize, Instant)> = None;
    loop {
        // Rows that came after the previous statement's wake (all but the
        // carried ones).
        let mut new_rows = 0usize;
        let mut batch = match carried.take() {
            Some(b) => b,
            None => match recv_spinning(rx) {
                Ok(b) => {
                    new_rows = batch_len(&b);
                    b
                }
                Err(_) => return,
            },
        };
        while let Ok(more) = rx.try_recv() {
            new_rows += batch_len(&more);
            merge(&mut batch, more);
        }
        if let Some((want, until)) = gather.take() {
            let enough = want - want / GATHER_SLACK_DIV;
            while new_rows < enough {
                match rx.recv_deadline(until) {
                    Ok(more) => {
                        new_rows += batch_len(&more);
                        merge(&mut batch, more);
                    }
                    Err(_) => break,
                }
            }
        }
        let low = batch
            .rows
            .iter()
            .map(|r| r.lsn)
            .chain(batch.snaps.iter().map(|s| s.lsn))
            .min()
            .unwrap_or(batch.last);
        poisoned.retain(|_, upto| *upto >= low);
        if let Ok(mut g) = shared.rejected.lock() {
            // No row below `low` is still to come.
            g.floors.retain(|_, f| *f > low);
        }
        let last = batch.last;
        let rows = batch_len(&batch);
        let started = Instant::now();
        for chunk in split(batch, settings) {
            let mut refused: Vec<(String, u64, u64, LogError)> = Vec::new();
            commit_chunk(
                settings,
                &mut client,
                chunk,
                &poisoned,
                &mut refused,
                health,
            );
            // Recorded before the next statement: an id's later rows in
            // the same batch (split over statements) are refused with it.
            // Sent on, the next of them would take the sequence number
            // after a newer incarnation's claim row (its next one) and
            // commit after the claim, or leave a gap after a refusal.
            record_refusals(shared, &mut poisoned, refused);
        }
        // What is queued now was appended before this wake: it goes in the
        // next statement whatever comes later.
        let mut queued: Option<Batch> = None;
        while let Ok(more) = rx.try_recv() {
            match queued.as_mut() {
                Some(q) => merge(q, more),
                None => queued = Some(more),
            }
        }
        carried = queued;
        let took = started.elapsed();
        if rows > 1 && took >= GATHER_FROM {
            gather = Some((rows, Instant::now() + took.min(GATHER_MAX)));
        }
        // `resolved` moves only after the refusals are recorded.
        shared.resolved.fetch_max(last, Ordering::SeqCst);
        shared.notify();
    }
}

/// How long a writer spins on an empty queue before it blocks (50 us): the
/// core's next appends usually come within one client round trip of the
/// last commit, and a blocked thread's wake-up costs 30-70 us on a VM.
/// Measured with `shardline-bench durable --journal postgres` (4 runs,
/// alternating, same binary otherwise): depth 1 went from 0.45x to
/// 0.56-0.57x the raw baseline's rows/s; depths 16 and 64 moved within
/// the noise. A spin on the data core's side (its durability task yielding
/// for up to 300 us instead of parking) halved depth 16's adds/s on two
/// vCPUs and was left out.
pub const WRITER_SPIN: Duration = Duration::from_micros(50);

/// The next batch: spins up to [`WRITER_SPIN`], then blocks.
fn recv_spinning(
    rx: &crossbeam_channel::Receiver<Batch>,
) -> Result<Batch, crossbeam_channel::RecvError> {
    let until = Instant::now() + WRITER_SPIN;
    loop {
        match rx.try_recv() {
            Ok(b) => return Ok(b),
            Err(crossbeam_channel::TryRecvError::Disconnected) => {
                return Err(crossbeam_channel::RecvError)
            }
            Err(crossbeam_channel::TryRecvError::Empty) => {}
        }
        if Instant::now() >= until {
            return rx.recv();
        }
        std::hint::spin_loop();
    }
}

/// Records the refusals of one statement, `(pid, lowest LSN, highest LSN,
/// why)`: the id's rows up to the highest LSN assigned on the core now are
/// refused from here on (`poisoned`), and its entity sees the refusal
/// until its next recovery (rows from before that recovery, and the
/// remember-entities ids, are left out).
fn record_refusals(
    shared: &CoreShared,
    poisoned: &mut HashMap<String, u64>,
    refused: Vec<(String, u64, u64, LogError)>,
) {
    if refused.is_empty() {
        return;
    }
    if let Ok(mut g) = shared.rejected.lock() {
        let assigned = g.assigned;
        for (pid, lo, hi, e) in refused {
            if is_remember(&pid) {
                continue;
            }
            if g.floors.get(&pid).is_some_and(|f| hi < *f) {
                // Rows from before the id's latest recovery.
                continue;
            }
            poisoned.insert(pid.clone(), assigned);
            g.entries.entry(pid).or_default().push((lo, hi, e));
        }
    }
}

/// A writer's connection and its prepared [`APPEND_SQL`] and
/// [`APPEND_EVENTS_SQL`].
type Conn = Option<(Client, postgres::Statement, postgres::Statement)>;

/// Splits a batch into statements within the limits, keeping the events'
/// LSN order (the snapshots ride with the first: each covers only events
/// that are durable already).
fn split(batch: Batch, settings: &PgSettings) -> Vec<Batch> {
    let max_rows = settings.batch_max_rows.max(1) as usize;
    let max_bytes = settings.batch_max_bytes.max(1);
    let mut out: Vec<Batch> = Vec::new();
    let mut cur = Batch {
        snaps: batch.snaps,
        ..Batch::default()
    };
    let mut bytes = 0u64;
    for r in batch.rows {
        let len = r.payload.len() as u64;
        if !cur.rows.is_empty() && (cur.rows.len() >= max_rows || bytes + len > max_bytes) {
            out.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        bytes += len;
        cur.last = r.lsn;
        cur.rows.push(r);
    }
    if !cur.rows.is_empty() || !cur.snaps.is_empty() {
        out.push(cur);
    }
    out
}

/// [`APPEND_SQL`] for a batch without snapshots: the events' insert
/// alone (the empty snapshot upsert costs a 1-row statement about 60 us of
/// the server's time, measured with `bench-harness/scripts/pg-append-explain.py`).
pub(crate) const APPEND_EVENTS_SQL: &str = "
INSERT INTO shardline_events (persistence_id, sequence_nr, writer_epoch, payload)
SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[], $4::bytea[])";

/// Commits one statement's rows; refused rows go to `refused` as
/// `(pid, lowest LSN, highest LSN, why)` (snapshots are not reported: a
/// snapshot that is not stored costs only replay time).
fn commit_chunk(
    settings: &PgSettings,
    client: &mut Conn,
    mut chunk: Batch,
    poisoned: &HashMap<String, u64>,
    refused: &mut Vec<(String, u64, u64, LogError)>,
    health: &Mutex<Option<String>>,
) {
    let refuse = |rows: Vec<Row>, e: &LogError, refused: &mut Vec<_>| {
        let mut by: HashMap<String, (u64, u64)> = HashMap::new();
        for r in rows {
            let b = by.entry(r.pid).or_insert((r.lsn, r.lsn));
            b.0 = b.0.min(r.lsn);
            b.1 = b.1.max(r.lsn);
        }
        for (pid, (lo, hi)) in by {
            refused.push((pid, lo, hi, e.clone()));
        }
    };
    // An id refused earlier stays refused until its entity recovered.
    let (bad, rows): (Vec<Row>, Vec<Row>) = std::mem::take(&mut chunk.rows)
        .into_iter()
        .partition(|r| poisoned.get(&r.pid).is_some_and(|upto| r.lsn <= *upto));
    if !bad.is_empty() {
        let e = LogError::unavailable(
            "journal unavailable: an earlier append of this persistence id failed".into(),
        );
        refuse(bad, &e, refused);
    }
    // Within one batch an id's highest epoch fences its older rows.
    let mut epochs: HashMap<&str, u64> = HashMap::new();
    for r in &rows {
        let e = epochs.entry(r.pid.as_str()).or_insert(0);
        *e = (*e).max(r.epoch);
    }
    for s in &chunk.snaps {
        let e = epochs.entry(s.pid.as_str()).or_insert(0);
        *e = (*e).max(s.epoch);
    }
    let epochs: HashMap<String, u64> = epochs
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    let (stale, rows): (Vec<Row>, Vec<Row>) = rows
        .into_iter()
        .partition(|r| epochs.get(&r.pid).is_some_and(|e| r.epoch < *e));
    for r in stale {
        let e = PgError::Fenced {
            pid: r.pid.clone(),
            epoch: r.epoch,
        }
        .to_log();
        refuse(vec![r], &e, refused);
    }
    let mut snaps: HashMap<String, SnapRow> = HashMap::new();
    for s in std::mem::take(&mut chunk.snaps) {
        if epochs.get(&s.pid).is_some_and(|e| s.epoch < *e) {
            continue;
        }
        match snaps.get(&s.pid) {
            Some(o) if o.seq >= s.seq => {}
            _ => {
                snaps.insert(s.pid.clone(), s);
            }
        }
    }
    if rows.is_empty() && snaps.is_empty() {
        return;
    }
    match run_append(settings, client, &rows, &snaps) {
        Ok(()) => set_health(health, None),
        Err(PgError::Unavailable(why)) => {
            *client = None;
            let e = LogError::unavailable(format!("journal unavailable: {why}"));
            set_health(health, Some(e.message.clone()));
            refuse(rows, &e, refused);
        }
        Err(e) => {
            let mut pids: Vec<&str> = rows.iter().map(|r| r.pid.as_str()).collect();
            pids.sort_unstable();
            pids.dedup();
            if pids.len() > 1 {
                // Find the ids the database refuses (a taken sequence
                // number fails the whole statement): the two halves of
                // the ids, each in a statement of its own, recursively.
                let upper: HashSet<String> = pids[pids.len() / 2..]
                    .iter()
                    .map(|p| p.to_string())
                    .collect();
                let mut halves = [Batch::default(), Batch::default()];
                for r in rows {
                    let b = &mut halves[usize::from(upper.contains(&r.pid))];
                    b.last = r.lsn;
                    b.rows.push(r);
                }
                for (pid, sn) in snaps {
                    halves[usize::from(upper.contains(&pid))].snaps.push(sn);
                }
                for b in halves {
                    commit_chunk(settings, client, b, poisoned, refused, health);
                }
            } else {
                if let PgError::SchemaTooNew { .. } = e {
                    *client = None;
                    set_health(health, Some(e.to_string()));
                }
                if !matches!(e, PgError::Fenced { .. }) {
                    tracing::warn!(error = %e, "journal append refused");
                }
                refuse(rows, &e.to_log(), refused);
            }
        }
    }
}

/// Runs [`APPEND_SQL`] once (connecting first when needed).
///
/// # Errors
/// [`PgError::Fenced`] (naming the statement's first id and highest
/// epoch) when an event's sequence number is taken: a newer incarnation
/// claimed one of the ids; else as [`PgError::classify`].
fn run_append(
    settings: &PgSettings,
    client: &mut Conn,
    rows: &[Row],
    snaps: &HashMap<String, SnapRow>,
) -> Result<(), PgError> {
    if client.as_ref().is_none_or(|(c, _, _)| c.is_closed()) {
        let mut c = connect(settings)?;
        let both = c.prepare(APPEND_SQL).map_err(|e| PgError::classify(&e))?;
        let events = c
            .prepare(APPEND_EVENTS_SQL)
            .map_err(|e| PgError::classify(&e))?;
        *client = Some((c, both, events));
    }
    let (c, both, events) = client
        .as_mut()
        .ok_or_else(|| PgError::Unavailable("no connection".into()))?;
    // In persistence id (bytewise, as the index's `COLLATE "C"` keys
    // compare for equal lengths) and sequence number order: every key
    // lock of the statement is taken in this one order.
    let mut rows: Vec<AppendRow<'_>> = rows
        .iter()
        .map(|r| (r.pid.as_str(), r.seq, r.epoch, r.payload.as_slice()))
        .collect();
    rows.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    let mut snaps: Vec<AppendRow<'_>> = snaps
        .values()
        .map(|s| (s.pid.as_str(), s.seq, s.epoch, s.data.as_slice()))
        .collect();
    snaps.sort_by(|a, b| a.0.cmp(b.0));
    execute_append(c, &*both, &*events, &rows, &snaps)
}

/// One row of [`APPEND_SQL`]'s arrays: `(persistence id, sequence number,
/// writer epoch, payload or snapshot bytes)`.
pub(crate) type AppendRow<'a> = (&'a str, u64, u64, &'a [u8]);

/// [`AppendRow`]s as the four array parameters of the journal's
/// statements (`$1::text[], $2::int8[], $3::int8[], $4::bytea[]`).
pub(crate) struct AppendColumns<'a> {
    pub(crate) pids: Vec<&'a str>,
    pub(crate) seqs: Vec<i64>,
    pub(crate) epochs: Vec<i64>,
    pub(crate) data: Vec<&'a [u8]>,
}

impl<'a> AppendColumns<'a> {
    /// The columns of `rows`, in their order.
    pub(crate) fn of(rows: &[AppendRow<'a>]) -> AppendColumns<'a> {
        AppendColumns {
            pids: rows.iter().map(|r| r.0).collect(),
            seqs: rows.iter().map(|r| r.1 as i64).collect(),
            epochs: rows.iter().map(|r| r.2 as i64).collect(),
            data: rows.iter().map(|r| r.3).collect(),
        }
    }
}

/// Runs `both` ([`APPEND_SQL`]) for `rows` and `snaps`, or `events_only`
/// ([`APPEND_EVENTS_SQL`]) when there are no snapshots; both sorted by
/// id and sequence number. The entities' writers pass their prepared
/// statements, the coordinators' journal the SQL text.
///
/// # Errors
/// [`PgError::Fenced`] (naming the first row's id and the highest epoch)
/// when an event's sequence number is taken: a newer incarnation claimed
/// one of the ids; else as [`PgError::classify`].
pub(crate) fn execute_append<T>(
    c: &mut Client,
    both: &T,
    events_only: &T,
    rows: &[AppendRow<'_>],
    snaps: &[AppendRow<'_>],
) -> Result<(), PgError>
where
    T: postgres::ToStatement + ?Sized,
{
    let e = AppendColumns::of(rows);
    let r = if snaps.is_empty() {
        c.execute(events_only, &[&e.pids, &e.seqs, &e.epochs, &e.data])
    } else {
        let s = AppendColumns::of(snaps);
        c.execute(
            both,
            &[
                &e.pids, &e.seqs, &e.epochs, &e.data, &s.pids, &s.seqs, &s.epochs, &s.data,
            ],
        )
    };
    r.map(|_| ()).map_err(|e| {
        if e.code() == Some(&SqlState::UNIQUE_VIOLATION) {
            PgError::Fenced {
                pid: rows.first().map_or_else(String::new, |r| r.0.to_string()),
                epoch: rows.iter().map(|r| r.2).max().unwrap_or(0),
            }
        } else {
            PgError::classify(&e)
        }
    })
}
