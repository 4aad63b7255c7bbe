//! The coordinators' state on PostgreSQL (`[journal] backend =
//! "postgres"`), and the cluster's identity kept in the database.
//!
//! With the PostgreSQL backend a ShardCoordinator incarnation keeps its
//! events, takeover records and snapshots in the same tables as durable
//! entities ([`super::pg::SCHEMA_SQL`]), under the persistence id
//! `coordinator|{type}` ([`super::coordinator::persistence_id`]) and with
//! the byte layout of [`super::coordinator`]: every member reads the same
//! rows, so the coordinator's allocation state survives any node, and a
//! whole cluster restarted onto empty `data_dir`s.
//!
//! Threads: no database I/O happens on the control executor. One thread
//! (`pg-control`) with its own connection runs, in order, the recovery
//! reads and the appends of this node's coordinators. The control
//! executor hands it appends (each gets an LSN of this journal's own
//! counter); the thread merges every append queued meanwhile into one
//! statement (`pg::APPEND_SQL`: one round trip, one transaction),
//! moves [`PgControlJournal::durable_lsn`] past them once it committed and
//! wakes the control executor through its [`DurableWake`]. A coordinator's
//! region messages wait for that LSN, as with the local control journal.
//!
//! Recovery ([`PgControlJournal::recover_start`]): the thread reads the
//! writer epoch recorded for the id, claims the next one (above it, and at
//! least the wall clock in ms, [`super::coordinator::next_epoch`]) and reads
//! the snapshot and the events after it ([`super::pg::claim_and_read`]).
//! The claim fences every older incarnation from then on: its appends are
//! refused by the database in the statement that would write them. While
//! the database cannot be reached the thread retries (backoff up to
//! [`RETRY_MAX`]) and [`PgControlJournal::health`] names the cause; the
//! coordinator starts only once the read succeeded, never empty for want
//! of the database. An append that cannot be committed is retried the same
//! way (the coordinator's messages wait meanwhile); one refused by the
//! database (fenced by a newer incarnation, or rejected) is reported by
//! [`PgControlJournal::take_refused`] and its coordinator stops.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use postgres::Client;
use shardline_core::sharding::{CoordinatorEvent, CoordinatorState};
use shardline_journal::{Lsn, WriterEpoch};

use super::coordinator::{
    decode_record, encode_event, encode_state, next_epoch, persistence_id, CoordinatorConfig,
    CoordinatorJournalError, CoordinatorRecord, RecoveredCoordinator, SNAPSHOT_EVERY_EVENTS,
};
use super::pg::{
    claim_and_read, connect, execute_append, AppendColumns, AppendRow, PgError, PgSettings,
    APPEND_EVENTS_SQL, APPEND_SQL,
};
use super::DurableWake;

/// The longest pause between two attempts while the database cannot be
/// reached (the first is 100 ms, doubled each time).
pub const RETRY_MAX: Duration = Duration::from_secs(1);

/// The name under which recovery and config errors name the database.
const SOURCE: &str = "PostgreSQL";

/// One row for [`APPEND_SQL`]: an event, or a snapshot.
#[derive(Debug, Clone)]
struct Row {
    type_name: String,
    pid: String,
    seq: u64,
    epoch: u64,
    data: Vec<u8>,
}

enum Req {
    Recover {
        ticket: u64,
        type_name: String,
        pid: String,
        expected: CoordinatorConfig,
    },
    Append {
        events: Vec<Row>,
        snaps: Vec<Row>,
        last: u64,
    },
}

/// A finished recovery: `(type, ticket, outcome, last sequence number)`.
type Finished = (
    String,
    u64,
    Result<(RecoveredCoordinator, u64), CoordinatorJournalError>,
);

#[derive(Default)]
struct Shared {
    /// Every LSN up to this one has an outcome (committed or refused).
    resolved: AtomicU64,
    /// Finished recovery reads.
    finished: Mutex<Vec<Finished>>,
    /// Appends the database refused: `(type, epoch, why)`.
    refused: Mutex<Vec<(String, u64, String)>>,
    /// The control executor's wake.
    wake: Mutex<Option<Arc<DurableWake>>>,
    /// Why the database is unusable now.
    health: Mutex<Option<String>>,
    /// Set when the journal is dropped: retries stop.
    closed: AtomicBool,
}

impl Shared {
    fn notify(&self) {
        if let Ok(w) = self.wake.lock() {
            if let Some(w) = w.as_ref() {
                w.notify();
            }
        }
    }

    fn set_health(&self, v: Option<String>) {
        if let Ok(mut g) = self.health.lock() {
            if *g != v {
                match &v {
                    Some(why) => tracing::warn!(
                        error = %why,
                        "coordinator journal database unavailable; retrying"
                    ),
                    None => tracing::info!("coordinator journal database available"),
                }
                *g = v;
            }
        }
    }
}

struct TypeLog {
    pid: String,
    epoch: WriterEpoch,
    /// Last sequence number appended (or recovered).
    seq: u64,
    since_snapshot: u64,
}

/// This node's coordinators' journal on PostgreSQL.
pub struct PgControlJournal {
    tx: Option<crossbeam_channel::Sender<Req>>,
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
    next_lsn: u64,
    next_ticket: u64,
    /// Types whose recovery is under way → its ticket.
    recovering: HashMap<String, u64>,
    /// Last sequence number of each recovered type (until it begins).
    recovered_seq: HashMap<String, u64>,
    types: HashMap<String, TypeLog>,
}

impl std::fmt::Debug for PgControlJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgControlJournal")
            .field("next_lsn", &self.next_lsn)
            .finish_non_exhaustive()
    }
}

impl PgControlJournal {
    /// Starts the journal's thread (`pg-control`); it connects on first
    /// use. `wake` is notified after every append's outcome and every
    /// finished recovery.
    pub fn open(settings: &PgSettings, wake: Arc<DurableWake>) -> PgControlJournal {
        let shared = Arc::new(Shared {
            wake: Mutex::new(Some(wake)),
            ..Shared::default()
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Req>();
        let s = settings.clone();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("pg-control".into())
            .spawn(move || control_loop(&s, &rx, &sh))
            .ok();
        PgControlJournal {
            tx: Some(tx),
            shared,
            thread,
            next_lsn: 1,
            next_ticket: 1,
            recovering: HashMap::new(),
            recovered_seq: HashMap::new(),
            types: HashMap::new(),
        }
    }

    /// Starts recovering `type_name`'s coordinator on the journal's thread
    /// (claiming a new writer epoch for it, see the module docs); the
    /// outcome comes from [`Self::take_recovered`] after the wake.
    ///
    /// # Errors
    /// [`CoordinatorJournalError::BadTypeName`].
    pub fn recover_start(
        &mut self,
        type_name: &str,
        expected: &CoordinatorConfig,
    ) -> Result<(), CoordinatorJournalError> {
        let pid = persistence_id(type_name)?;
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.recovering.insert(type_name.to_string(), ticket);
        self.send(Req::Recover {
            ticket,
            type_name: type_name.to_string(),
            pid: pid.as_str().to_string(),
            expected: expected.clone(),
        });
        Ok(())
    }

    /// Whether a recovery of `type_name` is under way.
    pub fn is_recovering(&self, type_name: &str) -> bool {
        self.recovering.contains_key(type_name)
    }

    /// The recoveries finished since the last call (of types still
    /// recovering: a type ended meanwhile is left out). A successful one's
    /// [`RecoveredCoordinator::claimed_epoch`] is the epoch its
    /// incarnation must [`Self::begin`] with.
    pub fn take_recovered(
        &mut self,
    ) -> Vec<(
        String,
        Result<RecoveredCoordinator, CoordinatorJournalError>,
    )> {
        let done = match self.shared.finished.lock() {
            Ok(mut g) => std::mem::take(&mut *g),
            Err(_) => Vec::new(),
        };
        let mut out = Vec::new();
        for (t, ticket, r) in done {
            if self.recovering.get(&t) != Some(&ticket) {
                continue;
            }
            self.recovering.remove(&t);
            out.push((
                t.clone(),
                r.map(|(rec, seq)| {
                    self.recovered_seq.insert(t, seq);
                    rec
                }),
            ));
        }
        out
    }

    /// Appends refused by the database since the last call: `(type,
    /// why)`, only of the types' current incarnations.
    pub fn take_refused(&mut self) -> Vec<(String, String)> {
        let v = match self.shared.refused.lock() {
            Ok(mut g) => std::mem::take(&mut *g),
            Err(_) => Vec::new(),
        };
        v.into_iter()
            .filter(|(t, epoch, _)| self.types.get(t).is_some_and(|l| l.epoch.0 == *epoch))
            .map(|(t, _, why)| (t, why))
            .collect()
    }

    /// Starts an incarnation of `type_name`'s coordinator with writer epoch
    /// `epoch` (the one its recovery claimed): queues the takeover record
    /// (`state` and `config`) after the recovered sequence numbers. Returns
    /// its LSN.
    ///
    /// # Errors
    /// [`CoordinatorJournalError::BadTypeName`]; the database refuses a
    /// fenced epoch later, through [`Self::take_refused`].
    pub fn begin(
        &mut self,
        type_name: &str,
        epoch: WriterEpoch,
        state: &CoordinatorState,
        config: &CoordinatorConfig,
    ) -> Result<Lsn, CoordinatorJournalError> {
        let pid = persistence_id(type_name)?.as_str().to_string();
        let seq = self.recovered_seq.remove(type_name).unwrap_or(0);
        self.types.insert(
            type_name.to_string(),
            TypeLog {
                pid,
                epoch,
                seq,
                since_snapshot: 0,
            },
        );
        self.push_event(type_name, encode_state(state, config))
    }

    /// Queues one event of `type_name`'s current incarnation. Returns its
    /// LSN; it is committed when [`Self::durable_lsn`] reaches it and
    /// [`Self::take_refused`] did not name the type.
    ///
    /// # Errors
    /// [`CoordinatorJournalError::NotBegun`].
    pub fn append(
        &mut self,
        type_name: &str,
        event: &CoordinatorEvent,
    ) -> Result<Lsn, CoordinatorJournalError> {
        let lsn = self.push_event(type_name, encode_event(event))?;
        if let Some(t) = self.types.get_mut(type_name) {
            t.since_snapshot += 1;
        }
        Ok(lsn)
    }

    fn push_event(
        &mut self,
        type_name: &str,
        data: Vec<u8>,
    ) -> Result<Lsn, CoordinatorJournalError> {
        let lsn = self.next_lsn;
        let t = self
            .types
            .get_mut(type_name)
            .ok_or_else(|| CoordinatorJournalError::NotBegun(type_name.to_string()))?;
        t.seq += 1;
        let row = Row {
            type_name: type_name.to_string(),
            pid: t.pid.clone(),
            seq: t.seq,
            epoch: t.epoch.0,
            data,
        };
        self.next_lsn += 1;
        self.send(Req::Append {
            events: vec![row],
            snaps: Vec::new(),
            last: lsn,
        });
        Ok(Lsn(lsn))
    }

    /// Whether [`SNAPSHOT_EVERY_EVENTS`] events were appended for
    /// `type_name` since its last snapshot (or its takeover record).
    pub fn snapshot_due(&self, type_name: &str) -> bool {
        self.types
            .get(type_name)
            .is_some_and(|t| t.since_snapshot >= SNAPSHOT_EVERY_EVENTS)
    }

    /// Queues `state` (the fold of every event appended so far) as the
    /// snapshot of `type_name`'s coordinator; it is written with the next
    /// statement (a snapshot that is not stored costs only replay time).
    ///
    /// # Errors
    /// [`CoordinatorJournalError::NotBegun`].
    pub fn save_snapshot(
        &mut self,
        type_name: &str,
        state: &CoordinatorState,
        config: &CoordinatorConfig,
    ) -> Result<(), CoordinatorJournalError> {
        let lsn = self.next_lsn;
        let t = self
            .types
            .get_mut(type_name)
            .ok_or_else(|| CoordinatorJournalError::NotBegun(type_name.to_string()))?;
        t.since_snapshot = 0;
        let row = Row {
            type_name: type_name.to_string(),
            pid: t.pid.clone(),
            seq: t.seq,
            epoch: t.epoch.0,
            data: encode_state(state, config),
        };
        self.next_lsn += 1;
        self.send(Req::Append {
            events: Vec::new(),
            snaps: vec![row],
            last: lsn,
        });
        Ok(())
    }

    /// The writer epoch of `type_name`'s current incarnation, if begun.
    pub fn epoch(&self, type_name: &str) -> Option<WriterEpoch> {
        self.types.get(type_name).map(|t| t.epoch)
    }

    /// Forgets `type_name`'s incarnation, or its recovery under way.
    pub fn end(&mut self, type_name: &str) {
        self.types.remove(type_name);
        self.recovering.remove(type_name);
        self.recovered_seq.remove(type_name);
    }

    /// Every LSN up to this one has an outcome: committed, or refused
    /// (reported by [`Self::take_refused`] before this moves past it).
    pub fn durable_lsn(&self) -> Lsn {
        Lsn(self.shared.resolved.load(Ordering::SeqCst))
    }

    /// Why the database is unusable now (the last attempt failed; cleared
    /// by the next that works).
    pub fn health(&self) -> Option<String> {
        self.shared.health.lock().ok().and_then(|h| h.clone())
    }

    fn send(&self, r: Req) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(r);
        }
    }
}

impl Drop for PgControlJournal {
    fn drop(&mut self) {
        // The thread commits what is queued, but stops retrying.
        self.tx = None;
        self.shared.closed.store(true, Ordering::SeqCst);
        if let Some(h) = self.thread.take() {
            let _ = h.join();
        }
    }
}

fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Runs `f` with a connection, retrying while the database cannot be
/// reached (until the journal is closed); other errors are returned.
fn with_retry<T>(
    settings: &PgSettings,
    client: &mut Option<Client>,
    shared: &Shared,
    mut f: impl FnMut(&mut Client) -> Result<T, PgError>,
) -> Result<T, PgError> {
    let mut pause = Duration::from_millis(100);
    loop {
        let r = (|| {
            if client.as_ref().is_none_or(Client::is_closed) {
                *client = Some(connect(settings)?);
            }
            let c = client
                .as_mut()
                .ok_or_else(|| PgError::Unavailable("no connection".into()))?;
            f(c)
        })();
        match r {
            Err(PgError::Unavailable(why)) => {
                *client = None;
                shared.set_health(Some(format!("journal unavailable: {why}")));
                if shared.closed.load(Ordering::SeqCst) {
                    return Err(PgError::Unavailable(why));
                }
                let until = Instant::now() + pause;
                while Instant::now() < until && !shared.closed.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                pause = (pause * 2).min(RETRY_MAX);
            }
            Err(e @ PgError::SchemaTooNew { .. }) => {
                *client = None;
                shared.set_health(Some(e.to_string()));
                return Err(e);
            }
            other => {
                shared.set_health(None);
                return other;
            }
        }
    }
}

fn control_loop(settings: &PgSettings, rx: &crossbeam_channel::Receiver<Req>, shared: &Shared) {
    let mut client: Option<Client> = None;
    let mut next: Option<Req> = None;
    loop {
        let req = match next.take() {
            Some(r) => r,
            None => match rx.recv() {
                Ok(r) => r,
                Err(_) => return,
            },
        };
        match req {
            Req::Recover {
                ticket,
                type_name,
                pid,
                expected,
            } => {
                let r = with_retry(settings, &mut client, shared, |c| recover_one(c, &pid))
                    .map_err(CoordinatorJournalError::Database)
                    .and_then(|r| fold(r, &expected));
                if let Ok(mut g) = shared.finished.lock() {
                    g.push((type_name, ticket, r));
                }
                shared.notify();
            }
            Req::Append {
                mut events,
                mut snaps,
                mut last,
            } => {
                // Group commit: every append queued meanwhile, up to the
                // next recovery (which must see them).
                while let Ok(more) = rx.try_recv() {
                    match more {
                        Req::Append {
                            events: e,
                            snaps: s,
                            last: l,
                        } => {
                            events.extend(e);
                            snaps.extend(s);
                            last = last.max(l);
                        }
                        r @ Req::Recover { .. } => {
                            next = Some(r);
                            break;
                        }
                    }
                }
                let refused = commit(settings, &mut client, shared, &events, &snaps);
                if !refused.is_empty() {
                    if let Ok(mut g) = shared.refused.lock() {
                        g.extend(refused);
                    }
                }
                // `resolved` moves only after the refusals are recorded.
                shared.resolved.fetch_max(last, Ordering::SeqCst);
                shared.notify();
            }
        }
    }
}

/// What a recovery read found: the claimed epoch, the epoch recorded
/// before, the snapshot and the events after it.
struct Read {
    claimed: u64,
    recorded: u64,
    rec: super::Recovered,
}

/// Reads the recorded writer epoch of `pid`, claims the next one and reads
/// the id (a claim that loses a race to another incarnation is retried
/// above the epoch that won, a few times).
fn recover_one(c: &mut Client, pid: &str) -> Result<Read, PgError> {
    let mut last = None;
    for _ in 0..5 {
        let recorded = c
            .query_opt(
                "SELECT writer_epoch FROM shardline_writers WHERE persistence_id = $1",
                &[&pid],
            )
            .map_err(|e| PgError::classify(&e))?
            .map_or(0, |r| r.get::<_, i64>(0) as u64);
        let claimed = next_epoch(WriterEpoch(recorded), wall_clock_ms()).0;
        match claim_and_read(c, pid, claimed, 0, true) {
            Ok(rec) => {
                return Ok(Read {
                    claimed,
                    recorded,
                    rec,
                })
            }
            Err(e @ PgError::Fenced { .. }) => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| PgError::Rejected(format!("cannot claim {pid}"))))
}

/// Folds a read into the coordinator's state; checks the recorded config.
fn fold(
    r: Read,
    expected: &CoordinatorConfig,
) -> Result<(RecoveredCoordinator, u64), CoordinatorJournalError> {
    let corrupt = |reason: String| CoordinatorJournalError::Corrupt {
        dir: PathBuf::from(SOURCE),
        reason,
    };
    let mut state = CoordinatorState::default();
    let mut config = None;
    let mut records = 0u64;
    let mut last_seq = 0u64;
    if let Some((seq, data)) = &r.rec.snapshot {
        match decode_record(data).map_err(corrupt)? {
            CoordinatorRecord::State(st, cfg) => {
                state = st;
                config = Some(cfg);
            }
            CoordinatorRecord::Event(_) => {
                return Err(corrupt("snapshot holds an event, not a state".into()))
            }
        }
        records += 1;
        last_seq = *seq;
    }
    for (seq, payload) in &r.rec.events {
        match decode_record(payload).map_err(|e| corrupt(format!("sequence nr {seq}: {e}")))? {
            CoordinatorRecord::State(st, cfg) => {
                state = st;
                config = Some(cfg);
            }
            CoordinatorRecord::Event(e) => state.apply(&e),
        }
        records += 1;
        last_seq = *seq;
    }
    // The claim row's sequence number is taken too.
    last_seq = last_seq.max(r.rec.highest);
    if let Some(cfg) = &config {
        if cfg != expected {
            return Err(CoordinatorJournalError::ConfigMismatch {
                dir: PathBuf::from(SOURCE),
                recorded_shards: cfg.number_of_shards,
                configured_shards: expected.number_of_shards,
                recorded_hash: cfg.hash_name.clone(),
                configured_hash: expected.hash_name.clone(),
            });
        }
    }
    Ok((
        RecoveredCoordinator {
            state,
            config,
            source: (records > 0).then(|| PathBuf::from(SOURCE)),
            records,
            highest_epoch: WriterEpoch(r.recorded),
            journals: usize::from(records > 0),
            claimed_epoch: Some(WriterEpoch(r.claimed)),
            from_database: true,
        },
        last_seq,
    ))
}

/// Commits `events` and `snaps` in one statement (retried while the
/// database cannot be reached); returns the refusals `(type, epoch, why)`.
fn commit(
    settings: &PgSettings,
    client: &mut Option<Client>,
    shared: &Shared,
    events: &[Row],
    snaps: &[Row],
) -> Vec<(String, u64, String)> {
    // The id's highest epoch in the batch fences its older rows (an
    // incarnation that ended here and its successor).
    let mut epochs: HashMap<&str, u64> = HashMap::new();
    for r in events.iter().chain(snaps) {
        let e = epochs.entry(r.pid.as_str()).or_insert(0);
        *e = (*e).max(r.epoch);
    }
    let mut refused: Vec<(String, u64, String)> = Vec::new();
    let fenced = |r: &Row| PgError::Fenced {
        pid: r.pid.clone(),
        epoch: r.epoch,
    };
    let (rows, stale): (Vec<&Row>, Vec<&Row>) = events
        .iter()
        .partition(|r| epochs[r.pid.as_str()] == r.epoch);
    for r in stale {
        refused.push((r.type_name.clone(), r.epoch, fenced(r).to_string()));
    }
    // One snapshot per id: the newest of the current epoch.
    let mut snap_of: HashMap<&str, &Row> = HashMap::new();
    for s in snaps.iter().filter(|s| epochs[s.pid.as_str()] == s.epoch) {
        match snap_of.get(s.pid.as_str()) {
            Some(o) if o.seq >= s.seq => {}
            _ => {
                snap_of.insert(s.pid.as_str(), s);
            }
        }
    }
    let mut rows = rows;
    rows.sort_by(|a, b| (a.pid.as_str(), a.seq).cmp(&(b.pid.as_str(), b.seq)));
    let mut s_rows: Vec<&Row> = snap_of.values().copied().collect();
    s_rows.sort_by(|a, b| a.pid.cmp(&b.pid));
    let r = with_retry(settings, client, shared, |c| append_once(c, &rows, &s_rows));
    match r {
        Ok(()) => {}
        Err(_) if rows.iter().any(|r| r.pid != rows[0].pid) => {
            // A taken sequence number fails the whole statement: one
            // statement per id finds the refused ones.
            let mut pids: Vec<&str> = rows.iter().map(|r| r.pid.as_str()).collect();
            pids.dedup();
            for p in pids {
                let own: Vec<&Row> = rows.iter().copied().filter(|r| r.pid == p).collect();
                let own_snaps: Vec<&Row> = s_rows.iter().copied().filter(|r| r.pid == p).collect();
                if let Err(e) = with_retry(settings, client, shared, |c| {
                    append_once(c, &own, &own_snaps)
                }) {
                    tracing::warn!(error = %e, "coordinator journal append refused");
                    for r in own {
                        refused.push((r.type_name.clone(), r.epoch, e.to_string()));
                    }
                }
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "coordinator journal append refused");
            for r in rows {
                refused.push((r.type_name.clone(), r.epoch, e.to_string()));
            }
        }
    }
    refused
}

/// [`append`], where a taken sequence number that holds this very row
/// (same id, sequence number, writer epoch and payload, not a claim row)
/// counts as committed: a retry after a lost commit reply (the statement
/// committed, the connection broke before its answer came, and
/// [`with_retry`] sends it again) finds its own rows, which are not a newer
/// incarnation's. Only rows of one incarnation can match: a claim row or a
/// newer writer's event differs in `claim` or `writer_epoch`.
///
/// # Errors
/// As [`append`]; [`PgError::Unavailable`] when the check's read fails.
fn append_once(c: &mut Client, rows: &[&Row], snaps: &[&Row]) -> Result<(), PgError> {
    match append(c, rows, snaps) {
        Err(PgError::Fenced { pid, epoch }) => {
            if rows_already_committed(c, rows)? {
                // The snapshot upsert rode in the same committed statement.
                Ok(())
            } else {
                Err(PgError::Fenced { pid, epoch })
            }
        }
        other => other,
    }
}

/// `rows` as the statements' [`AppendRow`]s.
fn append_rows<'a>(rows: &[&'a Row]) -> Vec<AppendRow<'a>> {
    rows.iter()
        .map(|r| (r.pid.as_str(), r.seq, r.epoch, r.data.as_slice()))
        .collect()
}

/// Whether every row of `rows` is stored as is (see [`append_once`]).
fn rows_already_committed(c: &mut Client, rows: &[&Row]) -> Result<bool, PgError> {
    if rows.is_empty() {
        return Ok(false);
    }
    let mine = AppendColumns::of(&append_rows(rows));
    let row = c
        .query_one(
            "SELECT count(*) FROM shardline_events e
             JOIN unnest($1::text[], $2::int8[], $3::int8[], $4::bytea[])
               AS mine(pid, seq, epoch, payload)
               ON e.persistence_id = mine.pid AND e.sequence_nr = mine.seq
             WHERE NOT e.claim AND e.writer_epoch = mine.epoch
               AND e.payload = mine.payload",
            &[&mine.pids, &mine.seqs, &mine.epochs, &mine.data],
        )
        .map_err(|e| PgError::classify(&e))?;
    let n: i64 = row.get(0);
    Ok(n == rows.len() as i64)
}

/// Runs [`APPEND_SQL`] once for `rows` and `snaps` (each sorted by id and
/// sequence number), through [`execute_append`].
///
/// # Errors
/// As [`execute_append`]: [`PgError::Fenced`] when an event's sequence
/// number is taken (a newer incarnation claimed the id).
fn append(c: &mut Client, rows: &[&Row], snaps: &[&Row]) -> Result<(), PgError> {
    execute_append(
        c,
        APPEND_SQL,
        APPEND_EVENTS_SQL,
        &append_rows(rows),
        &append_rows(snaps),
    )
}

/// The table that keeps each cluster's identity (created with
/// [`super::pg::SCHEMA_SQL`]): `cluster_name → cluster_id`.
const CLUSTER_ID_SQL: &str = "
WITH ins AS (
    INSERT INTO shardline_clusters (cluster_name, cluster_id) VALUES ($1, $2)
    ON CONFLICT (cluster_name) DO NOTHING
    RETURNING cluster_id
)
SELECT cluster_id FROM ins
UNION ALL
SELECT cluster_id FROM shardline_clusters WHERE cluster_name = $1
LIMIT 1";

/// The id of the cluster named `cluster_name` as the database records it;
/// recorded first as `proposed` when the database has none (the first
/// node of a new cluster; racing nodes all get the id that won).
///
/// # Errors
/// [`PgError::Unavailable`] when the database cannot be reached,
/// [`PgError::SchemaTooNew`], [`PgError::Rejected`].
pub fn cluster_id(
    settings: &PgSettings,
    cluster_name: &str,
    proposed: &str,
) -> Result<String, PgError> {
    let mut c = connect(settings)?;
    let err = |e: postgres::Error| PgError::classify(&e);
    if let Some(row) = c
        .query_opt(CLUSTER_ID_SQL, &[&cluster_name, &proposed])
        .map_err(err)?
    {
        return Ok(row.get::<_, String>(0));
    }
    // A node that raced this one inserted first (after this statement's
    // snapshot was taken): read what it committed.
    let row = c
        .query_one(
            "SELECT cluster_id FROM shardline_clusters WHERE cluster_name = $1",
            &[&cluster_name],
        )
        .map_err(err)?;
    Ok(row.get::<_, String>(0))
}
