//! Per-core journal wiring for durable entities.
//!
//! Every data core owns one [`shardline_journal::Journal`] in
//! `{data_dir}/journal/core-{index}` (or a [`pg::PgLog`] on the shared
//! database), held in a [`CoreJournal`] that the core's entity host owns
//! and lends to each entity call; entities reach it as an [`EventLog`]
//! through [`crate::entity::EntityContext::journal`].
//!
//! Durability notices never block the executor: after a turn that
//! appended, [`CoreJournal::arm`] registers a callback on the journal's
//! [`DurabilityWatcher`](shardline_journal::DurabilityWatcher); the sync
//! thread runs it, and it sets a flag and wakes the core's waiting task
//! ([`DurableWake::wait`]) through monoio's cross-thread waker (the same
//! mechanism as the runtime's rings). Under `durability = "none"` an
//! appended event counts as done at once (nothing is ever flushed on
//! purpose, so there is nothing to wait for).
//!
//! Deployment across machines: see `docs/persistence.md`; a shard that
//! moves recovers from the journal directory of the core that wrote it,
//! which must be readable from the new home: every member's `data_dir`
//! under one data root (one machine). Only the journals of this node's
//! cluster are read ([`identity::DataScope`]); a node whose durable types
//! use the local journal does not join members of another data root, and
//! a recovery refuses to start an entity while a member whose journal is
//! unreadable from here is in the cluster.

pub mod coordinator;
pub mod identity;
pub mod pg;
pub mod pg_control;
pub mod remember;

pub use identity::{DataDirLock, DataScope, IdentityError, LOCK_FILE};

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};

use shardline_journal::{
    Durability, Journal, JournalOptions, Lsn, PersistenceId, SequenceNr, WriterEpoch,
};

/// How a recovered history of one persistence id falls short of whole
/// (see [`check_history`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum HistoryGap {
    /// A sequence number is missing between the snapshot and the last
    /// event.
    #[error("not contiguous: expected sequence number {expected}, found {found}")]
    Gap {
        /// The sequence number that should have come next.
        expected: u64,
        /// The one that came.
        found: u64,
    },
    /// The history ends below the highest sequence number the journals
    /// hold: a snapshot that covered the rest is missing or damaged.
    #[error(
        "not all recoverable: what is left reaches sequence number {reached} of {highest} \
         (a snapshot that covered the rest is missing or damaged)"
    )]
    Short {
        /// The highest sequence number recovered.
        reached: u64,
        /// The highest the journals hold.
        highest: u64,
    },
}

/// Checks a recovered history of one id: the sequence numbers `seqs` of
/// the events after the snapshot at `from` (0: no snapshot), in order, run
/// without a gap from `from + 1`, and the history reaches `highest`, the
/// highest sequence number the journals hold for the id (0: no such
/// requirement). Returns the highest sequence number recovered. Every
/// writer of the engine numbers an id's records one above the last, so
/// anything else is damage, not a history.
///
/// # Errors
/// [`HistoryGap::Gap`] at the first missing number; [`HistoryGap::Short`]
/// when the history ends below `highest`.
pub(crate) fn check_history(
    from: u64,
    seqs: impl IntoIterator<Item = u64>,
    highest: u64,
) -> Result<u64, HistoryGap> {
    let mut reached = from;
    for found in seqs {
        let expected = reached + 1;
        if found != expected {
            return Err(HistoryGap::Gap { expected, found });
        }
        reached = found;
    }
    if reached < highest {
        return Err(HistoryGap::Short { reached, highest });
    }
    Ok(reached)
}

/// The journal operations durable entities need, so that entity logic can
/// be tested against an in-memory log.
pub trait EventLog {
    /// Appends one event; returns its LSN.
    ///
    /// # Errors
    /// A description when the journal refuses it (fenced epoch, poisoned,
    /// sequence number not increasing, I/O).
    fn append(
        &mut self,
        pid: &PersistenceId,
        seq: SequenceNr,
        epoch: WriterEpoch,
        payload: &[u8],
    ) -> Result<Lsn, String>;

    /// The latest snapshot `(sequence number, bytes)` of `pid`, and the
    /// events after it `(sequence number, payload)`, in order, for an
    /// incarnation appending with `epoch` (the shard's generation).
    ///
    /// # Errors
    /// A description when a record or snapshot cannot be read.
    fn recover(&mut self, pid: &PersistenceId, epoch: WriterEpoch) -> Result<Recovered, String>;

    /// Saves a snapshot of `pid` that includes events up to `seq`. The
    /// journal writes it without flushing on this (the core's) thread and
    /// makes it durable on its own thread; the events it covers stay until
    /// it is durable, and a failure poisons the journal (every later
    /// durability wait reports it).
    ///
    /// # Errors
    /// A description when the journal refuses it (fenced, bad sequence nr).
    fn save_snapshot(
        &mut self,
        pid: &PersistenceId,
        seq: SequenceNr,
        epoch: WriterEpoch,
        data: &[u8],
    ) -> Result<(), String>;

    /// The highest LSN whose record is durable under the policy (under
    /// "none": the highest appended).
    fn durable_lsn(&self) -> Lsn;

    /// Whether every append is durable (under the policy) when `append`
    /// returns and is never rejected afterwards ([`Self::rejected`]): the
    /// local journal under `durability = "none"`. A durable entity then
    /// runs an event's handler and answers its command in the same call,
    /// with nothing queued. Default: false.
    fn durable_on_append(&self) -> bool {
        false
    }

    /// The persistence id `id` as the log already holds it (shared, so
    /// that a writer's copy costs no allocation), if it does. Default:
    /// none (the caller builds its own).
    fn persistence_id(&self, _id: &str) -> Option<PersistenceId> {
        None
    }

    /// The last sequence number of `pid` in this journal (0: none).
    fn highest_sequence_nr(&self, pid: &PersistenceId) -> u64;

    /// Blocks until `lsn` is durable. Not called on a data core (a
    /// stopping entity with events in flight is kept until the journal's
    /// notice, [`crate::entity::Entity::on_stopping`]); for callers on other
    /// threads (tests, tools).
    ///
    /// # Errors
    /// A description when it will never be durable (poisoned, closed).
    fn wait_durable(&mut self, lsn: Lsn) -> Result<(), String>;

    /// Starts the recovery of `pid` for an incarnation writing with
    /// `epoch`, reading only what comes after sequence number `after_seq`
    /// (0: everything; the latest snapshot newer than it, then the events
    /// after that). The default reads at once through [`Self::recover`].
    fn recover_start(
        &mut self,
        pid: &PersistenceId,
        epoch: WriterEpoch,
        after_seq: u64,
    ) -> RecoverStart {
        RecoverStart::Ready(
            self.recover(pid, epoch)
                .map(|r| r.after(after_seq))
                .map_err(LogError::failed),
        )
    }

    /// The result of the recovery `ticket` of `pid` once it is read
    /// (taking it), `None` while it is in flight.
    fn recover_poll(
        &mut self,
        _pid: &PersistenceId,
        _ticket: u64,
    ) -> Option<Result<Recovered, LogError>> {
        None
    }

    /// The incarnation that started recovery `ticket` stopped: drop its
    /// result.
    fn recover_forget(&mut self, _ticket: u64) {}

    /// Whether the append of `pid` at `lsn` (durable LSN at or past it)
    /// was refused, and why. After a refusal, appends of `pid` are refused
    /// until its next recovery ([`Self::recover_start`]), so that no later
    /// event lands after a lost one.
    fn rejected(&mut self, _pid: &PersistenceId, _lsn: Lsn) -> Option<LogError> {
        None
    }

    /// Sends what this turn appended to the backend (the PostgreSQL
    /// backend's group commit; the local journal needs nothing).
    fn flush(&mut self) {}

    /// Housekeeping on the core's timer (every 5 ms), whether or not
    /// anything was appended: the local journal takes up the index files
    /// made durable since and carries on its segments' obsolescence counts
    /// ([`shardline_journal::Journal::maintain`]), which otherwise waited
    /// for the next append. Default: nothing.
    fn maintain(&mut self) {}

    /// Whether the log wakes the core itself when its durable LSN moves
    /// (no [`shardline_journal::DurabilityWatcher`] to register with).
    fn self_notifying(&self) -> bool {
        false
    }

    /// Why the backend is unusable now (database unreachable), if it is.
    fn health(&self) -> Option<String> {
        None
    }

    /// Tells the log the highest shard generation of the type whose
    /// entity is about to start on this core (the entity host calls it
    /// before `on_start`), so that one reopening of the other journals
    /// serves every shard already hosted. Default: nothing.
    fn set_hosted_generation(&mut self, _generation: u64) {}
}

/// What kind of refusal a [`LogError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogErrorKind {
    /// The journal backend cannot be reached (database down): retry later.
    Unavailable,
    /// A newer incarnation's writer epoch is recorded: this incarnation
    /// must stop.
    Fenced,
    /// Anything else (corrupt or missing records, refused data).
    Failed,
}

/// A journal refusal with the status a command gets for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogError {
    /// The kind.
    pub kind: LogErrorKind,
    /// What happened, for logs and error replies.
    pub message: String,
}

impl LogError {
    /// A [`LogErrorKind::Unavailable`] error.
    pub fn unavailable(message: String) -> LogError {
        LogError {
            kind: LogErrorKind::Unavailable,
            message,
        }
    }
    /// A [`LogErrorKind::Fenced`] error.
    pub fn fenced(message: String) -> LogError {
        LogError {
            kind: LogErrorKind::Fenced,
            message,
        }
    }
    /// A [`LogErrorKind::Failed`] error.
    pub fn failed(message: String) -> LogError {
        LogError {
            kind: LogErrorKind::Failed,
            message,
        }
    }
    /// The reply status of a command refused with this error:
    /// `JournalUnavailable` for [`LogErrorKind::Unavailable`], else
    /// `EntityFailed`.
    pub fn status(&self) -> crate::envelope::Status {
        match self.kind {
            LogErrorKind::Unavailable => crate::envelope::Status::JournalUnavailable,
            _ => crate::envelope::Status::EntityFailed,
        }
    }
}

impl std::fmt::Display for LogError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// How [`EventLog::recover_start`] answered.
#[derive(Debug)]
pub enum RecoverStart {
    /// Read at once (the local journal).
    Ready(Result<Recovered, LogError>),
    /// Read on another thread: poll [`EventLog::recover_poll`] with this
    /// ticket after the core's durability wake fired.
    Pending(u64),
}

/// A recovered persistence id: latest snapshot and the events after it.
#[derive(Debug, Default, Clone)]
pub struct Recovered {
    /// `(sequence number of the last event it includes, bytes)`.
    pub snapshot: Option<(u64, Vec<u8>)>,
    /// `(sequence number, payload)` in order.
    pub events: Vec<(u64, Vec<u8>)>,
    /// The highest sequence number taken for the id when it was read: at
    /// least the last event's (or the snapshot's); with the PostgreSQL
    /// journal, the last claim row the recovery wrote (see
    /// [`pg::claim_and_read`]). The incarnation's next event is one more.
    pub highest: u64,
}

impl Recovered {
    /// What of this read comes after sequence number `after_seq`: the
    /// snapshot only if it is newer, then the events after the snapshot
    /// (or after `after_seq` without one).
    pub fn after(mut self, after_seq: u64) -> Recovered {
        if self.snapshot.as_ref().is_some_and(|s| s.0 <= after_seq) {
            self.snapshot = None;
        }
        let from = self.snapshot.as_ref().map_or(after_seq, |s| s.0);
        self.events.retain(|e| e.0 > from);
        self
    }
}

/// Segment size of a core journal, in bytes (16 MiB: about 250,000
/// counter events; a node preallocates two per data core).
pub const SEGMENT_SIZE_BYTES: u64 = 16 << 20;

/// The journal of one data core as an [`EventLog`].
pub struct CoreLog {
    journal: Journal,
    none: bool,
    dir: PathBuf,
    /// Read-only views of the other journals under the data root, by
    /// directory (as [`foreign_key`] names it).
    foreign: Vec<(ForeignKey, shardline_journal::JournalReader)>,
    /// Per entity type: the highest shard generation hosted here when the
    /// readers were last opened.
    foreign_epoch: std::collections::HashMap<String, u64>,
    /// The node's data scope (cluster identity, readable siblings).
    scope: Option<Arc<DataScope>>,
    /// The highest shard generation of the type whose entity starts next
    /// ([`EventLog::set_hosted_generation`]).
    hosted_generation: u64,
}

impl CoreLog {
    /// Opens (creating) the journal of core `index` under `data_dir` with
    /// the node's durability policy.
    ///
    /// # Errors
    /// [`shardline_journal::OpenError`] when the directory cannot be
    /// created or recovered.
    pub fn open(
        data_dir: &Path,
        index: u16,
        durability: &crate::config::Durability,
    ) -> Result<CoreLog, shardline_journal::OpenError> {
        let dir = core_dir(data_dir, index);
        let durability = journal_durability(durability);
        let options = JournalOptions {
            durability,
            segment_size_bytes: SEGMENT_SIZE_BYTES,
            ..JournalOptions::default()
        };
        let (journal, report) = Journal::open(&dir, options)?;
        if let Some(w) = recovery_warning(&dir, &report) {
            tracing::warn!("{w}");
        }
        Ok(CoreLog {
            journal,
            none: matches!(durability, Durability::None),
            dir,
            foreign: Vec::new(),
            foreign_epoch: std::collections::HashMap::new(),
            scope: None,
            hosted_generation: 0,
        })
    }

    /// Every other core journal this core may read: the other cores of its
    /// own `data_dir`, and (with a [`DataScope`]) the core journals of the
    /// sibling `data_dir`s under the data root that record this node's
    /// cluster ([`DataScope::cluster_siblings`]): `{root}/*/journal/core-*`.
    /// A journal of another cluster is never read.
    fn foreign_dirs(&self) -> Vec<PathBuf> {
        let mut out = Vec::new();
        let own = std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        let Some(node) = self.dir.parent().and_then(Path::parent) else {
            return out;
        };
        let mut nodes = vec![node.to_path_buf()];
        if let Some(scope) = &self.scope {
            nodes.extend(scope.cluster_siblings());
        }
        for n in nodes {
            let Ok(cores) = std::fs::read_dir(n.join("journal")) else {
                continue;
            };
            for c in cores.flatten() {
                let p = c.path();
                // A core's journal is a directory `core-<index>` (or a link
                // to one); a file of another name or kind there is no
                // journal (a stray `core-7x` file made every recovery
                // fail, naming it unreadable).
                let is_core = p
                    .file_name()
                    .and_then(|f| f.to_str())
                    .and_then(|f| f.strip_prefix("core-"))
                    .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                    && c.file_type().is_ok_and(|t| t.is_dir() || t.is_symlink());
                let canon = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
                if is_core && canon != own {
                    out.push(p);
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// Brings the foreign readers up to date unless they were when a
    /// shard of `pid`'s type with generation `epoch` was already hosted
    /// here (then every event an earlier home wrote before the hand-off is
    /// visible to them: generations grow with every allocation, and a
    /// shard is allocated here only after its previous home handed it off
    /// or was removed). A reader already open reads only what its journal
    /// gained since ([`shardline_journal::JournalReader::refresh`]: about
    /// 1 ms after 1,000 appends to a journal of a million ids, which took
    /// 0.35-0.75 s to open again, on this data core); a journal that
    /// appeared is opened, one that is gone dropped.
    ///
    /// # Errors
    /// A description naming the directory when a journal of this cluster
    /// cannot be opened (recovering without it could start an entity
    /// without its events); nothing is cached then, the next recovery
    /// tries again.
    fn refresh_foreign(&mut self, pid: &PersistenceId, epoch: WriterEpoch) -> Result<(), String> {
        let type_name = pid.as_str().split('|').next().unwrap_or("");
        if self
            .foreign_epoch
            .get(type_name)
            .is_some_and(|e| *e >= epoch.0)
        {
            return Ok(());
        }
        let mut open: std::collections::HashMap<ForeignKey, shardline_journal::JournalReader> =
            std::mem::take(&mut self.foreign).into_iter().collect();
        for d in self.foreign_dirs() {
            let key = foreign_key(&d);
            let r = match open.remove(&key) {
                Some(r) => r.refresh(),
                None => shardline_journal::JournalReader::open(&d),
            };
            match r {
                Ok(r) => self.foreign.push((key, r)),
                Err(e) => {
                    self.foreign.clear();
                    self.foreign_epoch.clear();
                    return Err(format!(
                        "journal unreadable: cannot read the journal {} of this cluster: {e}; \
                         not starting the entity without its events",
                        d.display()
                    ));
                }
            }
        }
        let hosted = self.hosted_generation.max(epoch.0);
        self.foreign_epoch.insert(type_name.to_string(), hosted);
        Ok(())
    }

    /// Sets the data scope whose cluster's sibling journals this log reads
    /// (nodes set it; without one only this `data_dir`'s cores are read).
    pub fn set_scope(&mut self, scope: Arc<DataScope>) {
        self.scope = Some(scope);
        self.foreign.clear();
        self.foreign_epoch.clear();
    }

    /// Refuses recovery while a member whose journal this node cannot read
    /// is (or was, since this node started) in the cluster: a shard of the
    /// entity may have been homed there, and its events would be missing.
    fn check_readable(&self, pid: &PersistenceId) -> Result<(), String> {
        let Some(scope) = &self.scope else {
            return Ok(());
        };
        let unreadable = scope.unreadable();
        let Some((addr, ident)) = unreadable.iter().next() else {
            return Ok(());
        };
        Err(format!(
            "journal unreadable: {} may have events in the journal of member {addr} \
             ({ident}), which this node ({}) cannot read; not starting it empty. With \
             journal.backend = \"local\" every member's data_dir must be under one data root \
             (one machine); use a shared journal backend across machines",
            pid.as_str(),
            scope.journal_identity()
        ))
    }

    /// The journal's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The journal (for the durability watcher).
    pub fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Highest appended LSN.
    fn written(&self) -> Lsn {
        Lsn(self.journal.next_lsn().0.saturating_sub(1))
    }
}

/// The journal directory of core `index` under a node's `data_dir`.
pub fn core_dir(data_dir: &Path, index: u16) -> PathBuf {
    data_dir.join("journal").join(format!("core-{index}"))
}

/// What a journal's opening cut, as the line to log at warn level (`None`
/// when it found the journal as it was left): the torn tail of its newest
/// segment, records past the last complete one, with the file, the offset
/// and the bytes cut. Those are writes a crash tore: not acknowledged
/// under `always`; under `none` or `interval`, possibly writes after the
/// last flush. (The empty segment and temporary files a run leaves are
/// removed at every opening: not worth a warning.)
pub fn recovery_warning(dir: &Path, report: &shardline_journal::RecoveryReport) -> Option<String> {
    report.torn_tail.as_ref().map(|t| {
        format!(
            "journal {}: torn tail cut: {} at offset {} ({} bytes cut: {}); records past the \
             last complete one were dropped",
            dir.display(),
            t.file,
            t.offset,
            t.bytes_cut,
            t.reason
        )
    })
}

/// The journal policy of a node config's `durability`.
pub fn journal_durability(d: &crate::config::Durability) -> Durability {
    use crate::config::{Durability as C, DurabilityName};
    match d {
        C::Named(DurabilityName::None) => Durability::None,
        C::Named(DurabilityName::Always) => Durability::Always,
        C::Interval { interval_ms } => {
            Durability::Interval(std::time::Duration::from_millis((*interval_ms).max(1)))
        }
    }
}

/// A sibling journal's directory as a reader of it is kept by: its
/// resolved path and the directory's inode, so that a link moved to
/// another journal, or a directory removed and made again under a new
/// inode, is opened afresh at once. (A refresh also reads afresh a
/// directory that no longer holds the records it read: ext4 may give a
/// directory made again the old inode.)
type ForeignKey = (PathBuf, u64);

/// The [`ForeignKey`] of `dir` (inode 0 when it cannot be read: the open
/// that follows fails and names it).
fn foreign_key(dir: &Path) -> ForeignKey {
    use std::os::unix::fs::MetadataExt;
    let canon = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let ino = std::fs::metadata(&canon).map_or(0, |m| m.ino());
    (canon, ino)
}

impl EventLog for CoreLog {
    fn append(
        &mut self,
        pid: &PersistenceId,
        seq: SequenceNr,
        epoch: WriterEpoch,
        payload: &[u8],
    ) -> Result<Lsn, String> {
        self.journal
            .append(pid, seq, epoch, payload)
            .map_err(|e| e.to_string())
    }

    fn recover(&mut self, pid: &PersistenceId, epoch: WriterEpoch) -> Result<Recovered, String> {
        // Merge this core's journal with every other journal of the data
        // root: the newest snapshot wins, then events after it by sequence
        // number (a shard that moved left its earlier events elsewhere).
        self.check_readable(pid)?;
        let mut parts = vec![self.journal.recover(pid).map_err(|e| e.to_string())?];
        self.refresh_foreign(pid, epoch)?;
        for (_, r) in &self.foreign {
            if r.highest_sequence_nr(pid).0 == 0 {
                continue;
            }
            parts.push(r.recover(pid).map_err(|e| e.to_string())?);
        }
        let snapshot = parts
            .iter()
            .filter_map(|p| p.snapshot.as_ref())
            .max_by_key(|s| s.sequence_nr)
            .map(|s| (s.sequence_nr.0, s.data.clone()));
        let from = snapshot.as_ref().map_or(0, |s| s.0);
        let mut events: Vec<(u64, Vec<u8>)> = parts
            .into_iter()
            .flat_map(|p| p.events)
            .filter(|e| e.sequence_nr.0 > from)
            .map(|e| (e.sequence_nr.0, e.payload))
            .collect();
        events.sort_by_key(|e| e.0);
        events.dedup_by_key(|e| e.0);
        // What was recovered must also reach the highest sequence number
        // any of the journals holds for the id: a snapshot that is missing
        // or damaged while the segments it covered are gone would otherwise
        // recover an older state without a word.
        let known = std::iter::once(self.journal.highest_sequence_nr(pid).0)
            .chain(
                self.foreign
                    .iter()
                    .map(|(_, r)| r.highest_sequence_nr(pid).0),
            )
            .max()
            .unwrap_or(0);
        let highest = check_history(from, events.iter().map(|e| e.0), known)
            .map_err(|e| format!("events of {} are {e}", pid.as_str()))?;
        Ok(Recovered {
            snapshot,
            events,
            highest,
        })
    }

    fn save_snapshot(
        &mut self,
        pid: &PersistenceId,
        seq: SequenceNr,
        epoch: WriterEpoch,
        data: &[u8],
    ) -> Result<(), String> {
        self.journal
            .save_snapshot(pid, seq, epoch, data)
            .map_err(|e| e.to_string())
    }

    fn highest_sequence_nr(&self, pid: &PersistenceId) -> u64 {
        self.journal.highest_sequence_nr(pid).0
    }

    fn persistence_id(&self, id: &str) -> Option<PersistenceId> {
        self.journal.persistence_id(id)
    }

    fn durable_lsn(&self) -> Lsn {
        if self.none {
            self.written()
        } else {
            self.journal.durable_lsn()
        }
    }

    fn durable_on_append(&self) -> bool {
        self.none
    }

    fn maintain(&mut self) {
        self.journal.maintain();
    }

    fn wait_durable(&mut self, lsn: Lsn) -> Result<(), String> {
        if self.none {
            return Ok(());
        }
        self.journal.wait_durable(lsn).map_err(|e| e.to_string())
    }

    fn set_hosted_generation(&mut self, generation: u64) {
        self.hosted_generation = generation;
    }
}

/// A flag set from the journal's sync thread that wakes one task on the
/// core's executor.
#[derive(Default)]
pub struct DurableWake {
    set: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl DurableWake {
    /// Sets the flag and wakes the waiting task (any thread).
    pub fn notify(&self) {
        self.set.store(true, Ordering::SeqCst);
        if let Ok(mut g) = self.waker.lock() {
            if let Some(w) = g.take() {
                w.wake();
            }
        }
    }

    /// Whether [`Self::notify`] was called since the last wait or take
    /// (clearing it).
    pub fn take_notified(&self) -> bool {
        self.set.swap(false, Ordering::SeqCst)
    }

    /// Waits until [`Self::notify`] was called since the last wait.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait(&self) {
        std::future::poll_fn(|cx| {
            if self.set.swap(false, Ordering::SeqCst) {
                return Poll::Ready(());
            }
            if let Ok(mut g) = self.waker.lock() {
                *g = Some(cx.waker().clone());
            }
            if self.set.swap(false, Ordering::SeqCst) {
                return Poll::Ready(());
            }
            Poll::Pending
        })
        .await
    }
}

/// One data core's journal, owned by the core's entity host and lent to
/// each entity call ([`crate::entity::EntityContext::journal`]): the
/// [`EventLog`] (none until the driver opens one), the local journal's
/// durability watcher, the LSN registered with it, the highest LSN
/// appended, and the sequence numbers of the remembered-entity records
/// ([`remember`]). Nothing of it is shared with another core or kept in a
/// thread-local.
#[derive(Default)]
pub struct CoreJournal {
    log: Option<Box<dyn EventLog>>,
    /// The local journal's watcher (`None` for a self-notifying log).
    watcher: Option<shardline_journal::DurabilityWatcher>,
    /// The LSN whose durability is registered with the watcher.
    armed: Option<u64>,
    /// The highest LSN appended through this journal.
    appended: Lsn,
    /// The local journal's `fdatasync` latency (for `/metrics`).
    flush_latency: Option<shardline_journal::FlushLatency>,
    /// Last sequence number per remembered-entity persistence id.
    pub(crate) remember_seq: std::collections::HashMap<String, u64>,
}

impl CoreJournal {
    /// A core journal with no log (durable entities fail with "no journal
    /// on this core" until one is installed).
    pub fn new() -> CoreJournal {
        CoreJournal::default()
    }

    /// Opens core `index`'s local journal under `data_dir`, with its
    /// durability watcher; with `scope`, it reads the sibling journals of
    /// the scope's cluster.
    ///
    /// # Errors
    /// As [`CoreLog::open`].
    pub fn open_local(
        data_dir: &Path,
        index: u16,
        durability: &crate::config::Durability,
        scope: Option<Arc<DataScope>>,
    ) -> Result<CoreJournal, shardline_journal::OpenError> {
        let mut log = CoreLog::open(data_dir, index, durability)?;
        if let Some(s) = scope {
            log.set_scope(s);
        }
        Ok(CoreJournal {
            watcher: Some(log.journal().watcher()),
            flush_latency: Some(log.journal().flush_latency()),
            log: Some(Box::new(log)),
            ..CoreJournal::default()
        })
    }

    /// Opens core `index`'s journal on the node's PostgreSQL backend
    /// `backend`: its writer thread wakes `wake` (the core's durability
    /// wake) after every commit and every recovery read, and `flush` is
    /// the wake of the core's task that sends each turn's appends
    /// ([`EventLog::flush`]).
    pub fn open_postgres(
        backend: &Arc<pg::PgJournal>,
        index: u16,
        wake: &Arc<DurableWake>,
        flush: &Arc<DurableWake>,
    ) -> CoreJournal {
        let mut log = pg::PgLog::open(backend, index);
        log.set_core_wake(wake.clone());
        log.set_flush_wake(flush.clone());
        CoreJournal::with_log_installed(Box::new(log))
    }

    /// A core journal on `log` (an in-memory log in tests; no watcher, so
    /// a wait for durability is served by the next [`Self::arm`] that
    /// finds the LSN durable, or at once when `log` notifies itself).
    pub fn with_log_installed(log: Box<dyn EventLog>) -> CoreJournal {
        CoreJournal {
            log: Some(log),
            ..CoreJournal::default()
        }
    }

    /// Removes the log (a local journal syncs and closes when dropped).
    pub fn take(&mut self) -> Option<Box<dyn EventLog>> {
        self.watcher = None;
        self.armed = None;
        self.log.take()
    }

    /// The log.
    ///
    /// # Errors
    /// `"no journal on this core"` when none is installed.
    pub fn log(&mut self) -> Result<&mut dyn EventLog, String> {
        match self.log.as_mut() {
            Some(l) => Ok(l.as_mut()),
            None => Err("no journal on this core".to_string()),
        }
    }

    /// The log, read-only (`None` when none is installed).
    pub fn log_ref(&self) -> Option<&dyn EventLog> {
        self.log.as_deref()
    }

    /// The local journal's `fdatasync` latency handle, when it is one.
    pub fn flush_latency(&self) -> Option<shardline_journal::FlushLatency> {
        self.flush_latency.clone()
    }

    /// Records that `lsn` was appended (the core arms its durability wake
    /// for the highest one).
    pub fn note_appended(&mut self, lsn: Lsn) {
        self.appended = self.appended.max(lsn);
    }

    /// The highest LSN appended.
    pub fn appended(&self) -> Lsn {
        self.appended
    }

    /// Makes `wake` fire once `lsn` is durable (at most one registration
    /// in flight; a later `lsn` is registered when the earlier one fires,
    /// [`Self::disarm_if_reached`]). Under "none", or when `lsn` is
    /// already durable, it fires at once; a self-notifying log (PostgreSQL)
    /// wakes the core after every outcome it produces, so nothing is
    /// registered.
    pub fn arm(&mut self, wake: &Arc<DurableWake>, lsn: Lsn) {
        let Some(log) = self.log.as_ref() else {
            return;
        };
        if log.self_notifying() {
            return;
        }
        if log.durable_lsn() >= lsn {
            wake.notify();
            return;
        }
        let Some(watcher) = self.watcher.as_ref() else {
            wake.notify();
            return;
        };
        if self.armed.is_some_and(|l| l >= lsn.0) {
            return;
        }
        self.armed = Some(lsn.0);
        let w = wake.clone();
        watcher.on_durable(lsn, move |_| w.notify());
    }

    /// Called by the core after its wake fired: clears the registration
    /// once its LSN is durable, so that [`Self::arm`] registers the next.
    pub fn disarm_if_reached(&mut self) {
        let durable = self.log.as_ref().map_or(Lsn(0), |l| l.durable_lsn());
        if self.armed.is_some_and(|l| l <= durable.0) {
            self.armed = None;
        }
    }
}

/// The identity of the journal a node's config selects, for the cluster's
/// sharding fingerprint: `"local"` for the local journals, else the
/// database's (`postgres:{system_identifier}/{database}`, see
/// [`pg::identity`]).
///
/// # Errors
/// [`pg::PgError`] when the database cannot be reached or refuses.
pub fn journal_identity(c: &crate::config::JournalConfig) -> Result<String, pg::PgError> {
    match pg::PgSettings::from_config(c) {
        None => Ok("local".to_string()),
        Some(s) => pg::identity(&s),
    }
}

/// A deferred reply, answered (see
/// [`crate::entity::EntityContext::complete`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The reply token [`crate::entity::EntityContext::defer_reply`] gave.
    pub token: u64,
    /// The reply's status.
    pub status: crate::envelope::Status,
    /// The reply's payload (bytes).
    pub payload: Vec<u8>,
}

/// One entity awaiting durability: its type, id and incarnation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DurableWaiter {
    pub type_name: compact_str::CompactString,
    pub id: shardline_core::ids::EntityId,
    pub incarnation: u64,
}

/// Entities awaiting durability on one core and the core's durability
/// wake: the part of the durable-entity protocol the data executor keeps
/// (the replies held until durable are the data plane's,
/// `node::plane::data`).
pub(crate) struct Hooks {
    waiting: Vec<DurableWaiter>,
    /// The incarnations in `waiting` (an incarnation number is unique on
    /// its core, so it names the entity): each waits once, found without a
    /// scan of `waiting`.
    queued: std::collections::HashSet<u64, foldhash::fast::RandomState>,
    /// The emptied buffer of an earlier [`Self::take_waiting`], reused.
    spare: Vec<DurableWaiter>,
    /// The core's durability wake.
    pub wake: Arc<DurableWake>,
}

impl Default for Hooks {
    fn default() -> Self {
        Hooks {
            waiting: Vec::new(),
            queued: Default::default(),
            spare: Vec::new(),
            wake: Arc::new(DurableWake::default()),
        }
    }
}

impl Hooks {
    /// Adds an entity to the ones that get
    /// [`crate::entity::Entity::on_durable`], and arms the wake for the
    /// highest LSN `journal` appended.
    pub fn wait(
        &mut self,
        journal: &mut CoreJournal,
        type_name: &str,
        id: &shardline_core::ids::EntityId,
        incarnation: u64,
    ) {
        self.add(type_name, id, incarnation);
        let lsn = journal.appended();
        journal.arm(&self.wake, lsn);
    }

    /// Adds a stopping incarnation kept by [`crate::entity::Entity::on_stopping`]:
    /// like [`Self::wait`], but the wake is armed only when `journal` has
    /// appends that are not durable yet (or notifies the core itself), never
    /// fired at once. An incarnation kept with nothing in flight (a user
    /// entity waiting for something else) is asked again on the core's
    /// next durability notice, at its stop wait and at the node's stop
    /// drain, instead of waking the core in a loop.
    pub fn wait_stopping(
        &mut self,
        journal: &mut CoreJournal,
        type_name: &str,
        id: &shardline_core::ids::EntityId,
        incarnation: u64,
    ) {
        self.add(type_name, id, incarnation);
        let lsn = journal.appended();
        if journal.log_ref().is_some_and(|l| l.durable_lsn() < lsn) {
            journal.arm(&self.wake, lsn);
        }
    }

    /// Adds a waiting entity once (by its incarnation).
    fn add(&mut self, type_name: &str, id: &shardline_core::ids::EntityId, incarnation: u64) {
        if self.queued.insert(incarnation) {
            self.waiting.push(DurableWaiter {
                type_name: type_name.into(),
                id: id.clone(),
                incarnation,
            });
        }
    }

    /// Takes the waiting entities (the core calls them, then re-adds those
    /// still waiting), in the order they were added; hand the emptied
    /// buffer back with [`Self::give_back`].
    pub fn take_waiting(&mut self) -> Vec<DurableWaiter> {
        self.queued.clear();
        let spare = std::mem::take(&mut self.spare);
        std::mem::replace(&mut self.waiting, spare)
    }

    /// Keeps the buffer a [`Self::take_waiting`] returned, emptied, for the
    /// next one (no allocation per durability round).
    pub fn give_back(&mut self, mut buf: Vec<DurableWaiter>) {
        buf.clear();
        if self.spare.capacity() == 0 {
            self.spare = buf;
        }
    }
}

#[cfg(test)]
mod core_journal_tests {
    use super::*;

    #[test]
    fn stray_files_beside_the_cores_journals_are_not_read_as_journals() {
        let dir = tempfile::tempdir().expect("tmp");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let pid = PersistenceId::new("counter|moved").expect("pid");
        {
            // Core 1 hosted the entity first.
            let mut j = CoreJournal::open_local(dir.path(), 1, &none, None).expect("open");
            let log = j.log().expect("log");
            log.append(&pid, SequenceNr(1), WriterEpoch(1), b"first")
                .expect("append");
        }
        let journals = dir.path().join("journal");
        std::fs::write(journals.join("core-7x"), b"q").expect("stray file");
        std::fs::write(journals.join("core-9"), b"q").expect("stray file");
        std::fs::create_dir(journals.join("core-backup")).expect("stray dir");
        // Core 0 recovers it from core 1's journal, past the strays.
        let mut j = CoreJournal::open_local(dir.path(), 0, &none, None).expect("open");
        let r = j
            .log()
            .expect("log")
            .recover(&pid, WriterEpoch(2))
            .expect("recovered");
        assert_eq!(r.events, vec![(1, b"first".to_vec())]);
    }

    #[test]
    fn a_sibling_journal_is_read_again_up_to_date_at_each_newer_generation() {
        let dir = tempfile::tempdir().expect("tmp");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let a = PersistenceId::new("counter|a").expect("pid");
        let events = |r: Recovered| r.events.into_iter().map(|e| e.0).collect::<Vec<_>>();
        let mut core0 = CoreJournal::open_local(dir.path(), 0, &none, None).expect("open");
        {
            // The shard lives on core 1 first (generation 1)...
            let mut core1 = CoreJournal::open_local(dir.path(), 1, &none, None).expect("open");
            for seq in 1..=3 {
                core1
                    .log()
                    .expect("log")
                    .append(&a, SequenceNr(seq), WriterEpoch(1), b"one")
                    .expect("append");
            }
            // ...moves to core 0 (generation 2), which reads core 1's
            // journal, opening a view of it...
            let r = core0.log().expect("log").recover(&a, WriterEpoch(2));
            assert_eq!(events(r.expect("recovered")), vec![1, 2, 3]);
            // ...back to core 1 (generation 3), which writes more...
            for seq in 4..=6 {
                core1
                    .log()
                    .expect("log")
                    .append(&a, SequenceNr(seq), WriterEpoch(3), b"three")
                    .expect("append");
            }
            // ...and to core 0 again (generation 4): its view, brought up
            // to date, has them.
            let r = core0.log().expect("log").recover(&a, WriterEpoch(4));
            assert_eq!(events(r.expect("recovered")), vec![1, 2, 3, 4, 5, 6]);
        }
        // Core 1's journal is removed and made again (a wiped data_dir):
        // core 0 reads the new one afresh, not the old one's ids.
        std::fs::remove_dir_all(core_dir(dir.path(), 1)).expect("remove");
        let b = PersistenceId::new("counter|b").expect("pid");
        let mut core1 = CoreJournal::open_local(dir.path(), 1, &none, None).expect("open");
        core1
            .log()
            .expect("log")
            .append(&b, SequenceNr(1), WriterEpoch(5), b"five")
            .expect("append");
        let log = core0.log().expect("log");
        let r = log.recover(&b, WriterEpoch(6)).expect("recovered");
        assert_eq!(events(r), vec![1]);
        let r = log.recover(&a, WriterEpoch(6)).expect("recovered");
        assert!(r.events.is_empty() && r.snapshot.is_none());
        assert_eq!(log.highest_sequence_nr(&a), 0);
        // Its files removed, the directory kept (same path, same inode),
        // and written again past the old journal's length: read afresh
        // too (the view finds the records it read gone).
        drop(core1);
        for f in std::fs::read_dir(core_dir(dir.path(), 1))
            .expect("list")
            .flatten()
        {
            std::fs::remove_file(f.path()).expect("remove");
        }
        let c = PersistenceId::new("counter|c").expect("pid");
        let mut core1 = CoreJournal::open_local(dir.path(), 1, &none, None).expect("open");
        for seq in 1..=5 {
            core1
                .log()
                .expect("log")
                .append(&c, SequenceNr(seq), WriterEpoch(7), b"seven")
                .expect("append");
        }
        let log = core0.log().expect("log");
        let r = log.recover(&c, WriterEpoch(8)).expect("recovered");
        assert_eq!(events(r), vec![1, 2, 3, 4, 5]);
        let r = log.recover(&b, WriterEpoch(8)).expect("recovered");
        assert!(r.events.is_empty() && r.snapshot.is_none());
        assert_eq!(log.highest_sequence_nr(&b), 0);
    }

    #[test]
    fn a_torn_tail_cut_at_open_is_reported_for_the_log() {
        let dir = tempfile::tempdir().expect("tmp");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let pid = PersistenceId::new("counter|a").expect("pid");
        {
            let mut j = CoreJournal::open_local(dir.path(), 0, &none, None).expect("open");
            let log = j.log().expect("log");
            for seq in 1..=3 {
                log.append(&pid, SequenceNr(seq), WriterEpoch(1), b"12345678")
                    .expect("append");
            }
        }
        let core = core_dir(dir.path(), 0);
        // Opened as the core opens it.
        let options = || JournalOptions {
            durability: journal_durability(&none),
            segment_size_bytes: SEGMENT_SIZE_BYTES,
            ..JournalOptions::default()
        };
        // The newest segment (the only one): its records end where its
        // non-zero bytes do (segments are zero-filled; an event's payload
        // is its last field). Bytes that are no record right after them:
        // a torn write.
        let seg = std::fs::read_dir(&core)
            .expect("dir")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "seg"))
            .max()
            .expect("a segment");
        let bytes = std::fs::read(&seg).expect("read");
        let end = bytes.iter().rposition(|b| *b != 0).expect("records") as u64 + 1;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&seg)
            .expect("seg");
        std::os::unix::fs::FileExt::write_all_at(&f, &[0xAB; 40], end).expect("write");
        drop(f);
        let (_, report) = Journal::open(&core, options()).expect("reopen");
        let w = recovery_warning(&core, &report).expect("a warning");
        assert!(w.contains("torn tail cut") && w.contains(".seg"), "{w}");
        assert!(w.contains(&format!("at offset {end}")), "{w}");
        // The three acknowledged events are intact.
        let mut j = CoreJournal::open_local(dir.path(), 0, &none, None).expect("open");
        assert_eq!(j.log().expect("log").highest_sequence_nr(&pid), 3);
        drop(j);
        // A journal closed cleanly opens with nothing to report.
        let (_, report) = Journal::open(&core, options()).expect("reopen");
        assert_eq!(recovery_warning(&core, &report), None, "{report:?}");
    }

    #[test]
    fn an_incarnation_waits_once_per_round_in_the_order_added() {
        let mut h = Hooks::default();
        let (a, b) = (
            shardline_core::ids::EntityId::new("a").expect("id"),
            shardline_core::ids::EntityId::new("b").expect("id"),
        );
        h.add("counter", &a, 1);
        h.add("counter", &b, 2);
        h.add("counter", &a, 1);
        let w = h.take_waiting();
        assert_eq!(
            w.iter().map(|w| w.incarnation).collect::<Vec<_>>(),
            vec![1, 2],
            "each incarnation once, in order"
        );
        h.give_back(w);
        assert!(h.take_waiting().is_empty(), "a round takes them all");
        // Added again in a later round (still waiting after its handler).
        h.add("counter", &a, 1);
        let w = h.take_waiting();
        assert_eq!(w.len(), 1);
        assert_eq!(
            (w[0].type_name.as_str(), w[0].id.as_str()),
            ("counter", "a")
        );
    }

    fn pid(s: &str) -> PersistenceId {
        PersistenceId::new(s).expect("pid")
    }

    #[test]
    fn two_cores_journals_are_separate_values() {
        let dir = tempfile::tempdir().expect("tempdir");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let mut a = CoreJournal::open_local(dir.path(), 0, &none, None).expect("open 0");
        let mut b = CoreJournal::open_local(dir.path(), 1, &none, None).expect("open 1");
        let la = a
            .log()
            .expect("log a")
            .append(&pid("t|1"), SequenceNr(1), WriterEpoch(1), b"x")
            .expect("append");
        a.note_appended(la);
        assert_eq!(a.appended(), la);
        assert_eq!(b.appended(), Lsn(0), "b appended nothing");
        assert_eq!(b.log().expect("log b").highest_sequence_nr(&pid("t|1")), 0);
        assert_eq!(a.log().expect("log a").highest_sequence_nr(&pid("t|1")), 1);
        assert!(a.flush_latency().is_some());
        assert!(a.take().is_some());
        assert_eq!(
            a.log().err().as_deref(),
            Some("no journal on this core"),
            "a taken journal is gone"
        );
        assert!(b.log().is_ok(), "the other core's journal stays");
    }

    #[test]
    fn a_recovery_that_cannot_reach_the_highest_sequence_number_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cdir = core_dir(dir.path(), 0);
        let small = || JournalOptions {
            segment_size_bytes: 4096,
            durability: Durability::Always,
            ..JournalOptions::default()
        };
        let p = pid("t|1");
        let (mut j, _) = Journal::open(&cdir, small()).expect("open");
        for s in 1..=60 {
            j.append(&p, SequenceNr(s), WriterEpoch(1), &[1u8; 100])
                .expect("append");
        }
        j.close().expect("close");
        let (mut j, _) = Journal::open(&cdir, small()).expect("reopen");
        // Too large for a slot of the snapshot table: a file of its own,
        // and the sealed segments it covers go.
        j.save_snapshot(&p, SequenceNr(60), WriterEpoch(1), &[7u8; 600])
            .expect("snapshot");
        j.close().expect("close");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        {
            let mut log = CoreLog::open(dir.path(), 0, &none).expect("open");
            let r = log.recover(&p, WriterEpoch(1)).expect("recover");
            assert_eq!(r.highest, 60);
        }
        // The snapshot file is lost: what is left of the events does not
        // reach 60, and the recovery says so instead of starting older.
        for e in std::fs::read_dir(&cdir).expect("dir").flatten() {
            if e.file_name().to_string_lossy().ends_with(".snap") {
                std::fs::remove_file(e.path()).expect("remove");
            }
        }
        let mut log = CoreLog::open(dir.path(), 0, &none).expect("open");
        let err = log.recover(&p, WriterEpoch(1)).expect_err("refused");
        assert!(err.contains("not all recoverable"), "{err}");
    }

    #[test]
    fn arm_fires_at_once_when_the_lsn_is_durable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let mut j = CoreJournal::open_local(dir.path(), 0, &none, None).expect("open");
        let wake = Arc::new(DurableWake::default());
        let lsn = j
            .log()
            .expect("log")
            .append(&pid("t|1"), SequenceNr(1), WriterEpoch(1), b"x")
            .expect("append");
        j.arm(&wake, lsn);
        assert!(wake.set.load(Ordering::SeqCst), "durable under none: fired");
        let mut empty = CoreJournal::new();
        let w2 = Arc::new(DurableWake::default());
        empty.arm(&w2, Lsn(5));
        assert!(
            !w2.set.load(Ordering::SeqCst),
            "no log: nothing to wait for"
        );
    }
}
