//! The journal: one writer per directory, and read-only readers.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crossbeam_channel::Sender;

use crate::error::{
    AppendError, CloseError, CorruptionKind, OpenError, ReplayError, SnapshotError,
};
use crate::format::{
    self, decode_record, encode_record_head, index_name, record_len_bytes, segment_name, Decoded,
    RecordFields, RecordKind, RecordView, SegmentHeader, Snapshot, SNAPSHOT_SUFFIX, TMP_SUFFIX,
};
use crate::ids::{Lsn, PersistenceId, SequenceNr, WriterEpoch};
use crate::recovery::{
    deleted_to, pid_hash, raise_deleted, recover, recover_with, Earlier, EntryRef, FileIndex,
    PidMap, PidState, RecoveryReport, SealedSegment, SegmentIndex,
};
use crate::storage::{MmapStorage, SegmentFile, Storage};
use crate::sync::{
    self, DurabilityError, DurabilityWatcher, MetaJob, PendingSnapshots, RemoveJob, Shared, SyncMsg,
};
use crate::table::SnapshotTable;

/// When appended records become durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// The journal never flushes on its own (the OS writes pages back when
    /// it likes); records are made durable when a segment is sealed, on
    /// close, and when someone waits for an LSN.
    None,
    /// One `fdatasync` per interval for everything appended since the last
    /// one (group commit).
    Interval(Duration),
    /// Every append rings the sync thread at once; appends that arrive
    /// while a flush runs share the next one (group commit). An append
    /// "completes" when [`Journal::wait_durable`] (or a
    /// [`DurabilityWatcher`]) says its LSN is durable.
    Always,
}

/// What recovery does with corruption before the tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoveryMode {
    /// Refuse to open, naming segment and offset (default).
    #[default]
    Strict,
    /// Cut the journal at the first corruption (losing every record after
    /// it) and report what was cut. Stale segments are removed.
    Repair,
}

/// Options for [`Journal::open`].
#[derive(Debug, Clone)]
pub struct JournalOptions {
    /// Size of each segment file, in bytes. Default 64 MiB; at least 4 KiB.
    pub segment_size_bytes: u64,
    /// Durability policy. Default [`Durability::Interval`] of 1 ms.
    pub durability: Durability,
    /// This writer's epoch; opening fails when the directory holds a
    /// segment of a higher epoch. Default 0.
    pub writer_epoch: WriterEpoch,
    /// What to do with corruption before the tail. Default strict.
    pub recovery: RecoveryMode,
    /// Scan every segment on open, even those with an index file (slower;
    /// finds bit rot in sealed segments at open instead of on replay).
    /// Default false.
    pub verify_all_on_open: bool,
    /// With [`Journal::open`] (memory-mapped storage): zero-fill new
    /// segments after preallocating them (see
    /// [`MmapStorage::with_zero_fill`]). Default true.
    pub zero_fill_segments: bool,
}

impl Default for JournalOptions {
    fn default() -> Self {
        Self {
            segment_size_bytes: 64 << 20,
            durability: Durability::Interval(Duration::from_millis(1)),
            writer_epoch: WriterEpoch(0),
            recovery: RecoveryMode::Strict,
            verify_all_on_open: false,
            zero_fill_segments: true,
        }
    }
}

/// One replayed record, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Its LSN.
    pub lsn: Lsn,
    /// Its persistence id.
    pub persistence_id: PersistenceId,
    /// Its sequence number.
    pub sequence_nr: SequenceNr,
    /// The writer epoch it was appended with.
    pub writer_epoch: WriterEpoch,
    /// Append time, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// The payload.
    pub payload: Vec<u8>,
}

impl Record {
    fn from_view(v: &RecordView<'_>, pid: &PersistenceId) -> Self {
        Record {
            lsn: v.lsn,
            persistence_id: pid.clone(),
            sequence_nr: v.sequence_nr,
            writer_epoch: v.writer_epoch,
            timestamp_ms: v.timestamp_ms,
            payload: v.payload.to_vec(),
        }
    }
}

/// What a persistence id recovers from: its latest snapshot and the events
/// after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// The latest snapshot, if any.
    pub snapshot: Option<Snapshot>,
    /// The events after the snapshot (or after the deleted ones), in order.
    pub events: Vec<Record>,
}

/// Wall-clock time in ms for record and header timestamps: the kernel's
/// `CLOCK_REALTIME_COARSE` (its time at the last timer tick, 1-4 ms old),
/// which costs a memory read where a precise read costs a timer read per
/// append (about 1 % of a data core at 500 k appends/s).
#[cfg(target_os = "linux")]
fn now_ms() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut ts) } == 0 {
        return (ts.tv_sec as u64)
            .saturating_mul(1000)
            .saturating_add(ts.tv_nsec as u64 / 1_000_000);
    }
    precise_now_ms()
}

#[cfg(not(target_os = "linux"))]
fn now_ms() -> u64 {
    precise_now_ms()
}

fn precise_now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

// ----------------------------------------------------------- shared reads

/// Segments, per persistence id state and snapshot file names: what a
/// writer and a reader both read from.
struct Catalog {
    storage: Arc<dyn Storage>,
    sealed: BTreeMap<Lsn, SealedSegment>,
    pids: PidMap<PidState>,
    /// How far each id with a deletion marker has its events deleted
    /// (apart from `pids`: few ids delete).
    deleted: PidMap<SequenceNr>,
    /// Sorted, so that the files of one id hash are a range (a journal may
    /// hold a snapshot per entity: hundreds of thousands).
    snapshot_files: std::collections::BTreeSet<String>,
    snapshot_names: std::sync::Mutex<HashMap<PersistenceId, String>>,
    /// Snapshots saved by this writer whose file is not durable in place
    /// yet (the meta thread renames them), or whose table write is not
    /// synced yet (key [`table_key`]): read from here meanwhile.
    pending_snapshots: PendingSnapshots,
    /// The snapshot table, where the storage has one: the snapshots whose
    /// encoding fits a slot (FORMAT.md, "Snapshot table").
    table: Option<Arc<SnapshotTable>>,
    /// The table held unreadable slots when it was opened: a write torn by
    /// a crash, or damage. A slot whose id cannot be read may have been an
    /// id's newest durable snapshot, so every recovery then checks that
    /// its events are all there (see
    /// [`Catalog::check_after_suspect_snapshot`]).
    table_suspect: bool,
}

/// The key of `pid`'s table save in the pending snapshots (no file name
/// starts with a NUL).
fn table_key(pid: &PersistenceId) -> String {
    format!("\0table\0{pid}")
}

/// Opens the snapshot table of `storage` (see [`SnapshotTable::open`]),
/// sharing the ids of `pids`; and whether its scan found unreadable slots
/// ([`Catalog::table_suspect`]).
fn open_snapshot_table(
    storage: &dyn Storage,
    writable: bool,
    pids: &PidMap<PidState>,
) -> Result<(Option<Arc<SnapshotTable>>, bool), OpenError> {
    let opened = SnapshotTable::open(storage, writable, |p| {
        pids.get_key_value(p.as_str()).map(|(k, _)| k.clone())
    })
    .map_err(open_io("opening the snapshot table"))?;
    Ok(match opened {
        Some((t, scan)) => (Some(Arc::new(t)), scan.unreadable_slots > 0),
        None => (None, false),
    })
}

fn snapshot_hash(pid: &PersistenceId) -> String {
    format!("{:08x}", crc32c::crc32c(pid.as_bytes()))
}

impl Catalog {
    fn segment_file<'a>(&self, s: &'a SealedSegment) -> Result<&'a dyn SegmentFile, ReplayError> {
        if s.file.get().is_none() {
            let f = self
                .storage
                .open_segment(&s.name, false)
                .map_err(|source| ReplayError::Io {
                    op: format!("opening {}", s.name),
                    source,
                })?;
            let _ = s.file.set(f);
        }
        s.file.get().map(|b| &**b).ok_or_else(|| ReplayError::Io {
            op: format!("opening {}", s.name),
            source: io::Error::other("segment handle missing"),
        })
    }

    /// Replays `pid`'s events from `from` in one segment (`segment`, file
    /// `name`, its bytes `bytes`) whose index entry for the id is `e`.
    fn replay_segment(
        name: &str,
        segment: Lsn,
        e: EntryRef<'_>,
        bytes: &[u8],
        pid: &PersistenceId,
        from: SequenceNr,
        f: &mut dyn FnMut(&RecordView<'_>),
    ) -> Result<u64, ReplayError> {
        if e.last_event_seq() < from {
            return Ok(0);
        }
        let mut n = 0;
        for (seq, off) in e.since(from) {
            let corrupt = |kind| ReplayError::Corrupt {
                segment,
                file: name.to_string(),
                offset: off as u64,
                kind,
            };
            match decode_record(bytes, off as u64) {
                Decoded::Record(r) => {
                    if r.persistence_id != pid.as_bytes()
                        || r.sequence_nr != seq
                        || r.kind != RecordKind::Event
                    {
                        return Err(corrupt(CorruptionKind::IndexMismatch));
                    }
                    f(&r);
                    n += 1;
                }
                Decoded::End => {
                    return Err(corrupt(CorruptionKind::Record(
                        format::RecordError::PartialHeader,
                    )))
                }
                Decoded::Invalid(reason) => return Err(corrupt(CorruptionKind::Record(reason))),
            }
        }
        Ok(n)
    }

    fn replay_sealed(
        &self,
        pid: &PersistenceId,
        from: SequenceNr,
        f: &mut dyn FnMut(&RecordView<'_>),
    ) -> Result<u64, ReplayError> {
        let mut n = 0;
        for s in self.sealed.values() {
            let e = s
                .entry(pid.as_str())
                .map_err(|reason| index_damage(s, reason))?;
            let Some(e) = e else {
                continue;
            };
            if e.last_event_seq() < from || e.has_no_events() {
                continue;
            }
            let file = self.segment_file(s)?;
            let view = file.view();
            n += Self::replay_segment(&s.name, s.index.id, e, &view, pid, from, f)?;
        }
        Ok(n)
    }

    fn start_seq(&self, pid: &PersistenceId, from: SequenceNr) -> Option<SequenceNr> {
        if !self.pids.contains_key(pid.as_str()) {
            return None;
        }
        Some(from.max(SequenceNr(self.deleted_to(pid.as_str()).0 + 1)))
    }

    /// How far `pid`'s events are deleted (0: none).
    fn deleted_to(&self, pid: &str) -> SequenceNr {
        deleted_to(&self.deleted, pid)
    }

    fn snapshot_candidates(&self, pid: &PersistenceId) -> Vec<String> {
        let prefix = format!("{}-", snapshot_hash(pid));
        self.snapshot_files
            .range(prefix.clone()..)
            .take_while(|n| n.starts_with(&prefix))
            .cloned()
            .collect()
    }

    /// `pid`'s latest snapshot and the events after it, read by `replay`
    /// (from a sequence number), checked against `last` (the id's highest
    /// sequence number in the journal) when the snapshot is suspect.
    fn recover(
        &self,
        pid: &PersistenceId,
        replay: impl FnOnce(SequenceNr) -> Result<Vec<Record>, ReplayError>,
        last: impl FnOnce() -> SequenceNr,
    ) -> Result<Recovery, ReplayError> {
        let (snapshot, suspect) = self
            .load_snapshot_checked(pid)
            .map_err(snapshot_to_replay)?;
        let from = snapshot
            .as_ref()
            .map_or(SequenceNr(1), |s| SequenceNr(s.sequence_nr.0 + 1));
        let events = replay(from)?;
        if suspect || self.table_suspect {
            self.check_after_suspect_snapshot(pid, from, last(), &events)?;
        }
        Ok(Recovery { snapshot, events })
    }

    /// `pid`'s newest snapshot, in the table or in a file, and whether it
    /// came from a table pair with an unreadable slot (see
    /// [`Catalog::check_after_suspect_snapshot`]).
    fn load_snapshot_checked(
        &self,
        pid: &PersistenceId,
    ) -> Result<(Option<Snapshot>, bool), SnapshotError> {
        let (in_table, suspect) = self.load_table_snapshot(pid)?;
        let in_file = self.load_file_snapshot(pid)?;
        Ok(match (in_table, in_file) {
            (Some(t), Some(f)) if f.sequence_nr > t.sequence_nr => (Some(f), false),
            (Some(t), _) => (Some(t), suspect),
            (None, Some(f)) => (Some(f), false),
            (None, None) => (None, suspect),
        })
    }

    fn load_snapshot(&self, pid: &PersistenceId) -> Result<Option<Snapshot>, SnapshotError> {
        self.load_snapshot_checked(pid).map(|(s, _)| s)
    }

    /// `pid`'s snapshot in the table: the pending save, else its pair.
    fn load_table_snapshot(
        &self,
        pid: &PersistenceId,
    ) -> Result<(Option<Snapshot>, bool), SnapshotError> {
        let Some(table) = &self.table else {
            return Ok((None, false));
        };
        let key = table_key(pid);
        let pending = self
            .pending_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .cloned();
        if let Some(b) = pending {
            let snap = Snapshot::decode(&b).map_err(|reason| SnapshotError::Corrupt {
                file: format::SNAPSHOT_TABLE_NAME.to_string(),
                reason,
            })?;
            return Ok((Some(snap), false));
        }
        let r = table.read(pid).map_err(|source| SnapshotError::Io {
            op: format!("reading the snapshot table for {pid}"),
            source,
        })?;
        // A pair that holds no valid snapshot of `pid` any more comes back
        // as none, suspect: recovery then checks what is left.
        Ok((r.snapshot, r.unreadable_slot))
    }

    /// After recovering `pid` from a table pair with an unreadable slot (or
    /// from a table that held one when it was opened): that slot was either
    /// a write torn before the table was synced (then the snapshot read is
    /// the last durable one and every event after it is still here) or
    /// damage to a newer durable snapshot, on which a segment removal may
    /// have relied. What was recovered (the snapshot, then `events`) must
    /// reach `last`, the id's highest sequence number in this journal,
    /// else the snapshot is reported damaged instead of recovering an old
    /// state. (A gap in the middle cannot be told from a history that left
    /// this journal and came back; the engine checks the merged history's
    /// sequence numbers.)
    fn check_after_suspect_snapshot(
        &self,
        pid: &PersistenceId,
        from: SequenceNr,
        last: SequenceNr,
        events: &[Record],
    ) -> Result<(), ReplayError> {
        let reached = events
            .last()
            .map_or(from.0.saturating_sub(1), |e| e.sequence_nr.0);
        let deleted_to = self.deleted_to(pid.as_str()).0;
        if reached >= last.0 || deleted_to >= last.0 {
            return Ok(());
        }
        Err(snapshot_to_replay(SnapshotError::Corrupt {
            file: format!(
                "{} (the pair of {pid}: a slot is unreadable, and what is left reaches sequence number {reached} of {})",
                format::SNAPSHOT_TABLE_NAME,
                last.0
            ),
            reason: format::FileDecodeError::BadChecksum,
        }))
    }

    /// `pid`'s snapshot in a file of its own.
    fn load_file_snapshot(&self, pid: &PersistenceId) -> Result<Option<Snapshot>, SnapshotError> {
        let known = self
            .snapshot_names
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(pid.as_str())
            .cloned();
        let candidates = match known {
            Some(n) => vec![n],
            None => self.snapshot_candidates(pid),
        };
        for name in candidates {
            let pending = self
                .pending_snapshots
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&name)
                .cloned();
            let read = match pending {
                Some(b) => Ok(b.to_vec()),
                None => self.storage.read_file(&name),
            };
            let bytes = match read {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(source) => {
                    return Err(SnapshotError::Io {
                        op: format!("reading {name}"),
                        source,
                    })
                }
            };
            let snap = Snapshot::decode(&bytes).map_err(|reason| SnapshotError::Corrupt {
                file: name.clone(),
                reason,
            })?;
            if snap.persistence_id == *pid {
                self.snapshot_names
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(pid.clone(), name);
                return Ok(Some(snap));
            }
        }
        Ok(None)
    }
}

// ----------------------------------------------------------- the writer

struct Active {
    name: String,
    file: Box<dyn SegmentFile>,
    size_bytes: u64,
    index: SegmentIndex,
}

type SpareJob = JoinHandle<io::Result<(String, Box<dyn SegmentFile>)>>;

/// Index entries a sealed segment's first count of its uncovered ids reads
/// at most per snapshot, deletion or roll (see `Journal::obsolete_scans`):
/// about 100 µs of the appending thread, where counting a 16 MiB
/// segment's quarter of a million ids at once paused it for tens of ms.
const OBSOLETE_COUNT_ENTRIES: usize = 1024;

/// Index entries an append reads at most while a count is unfinished (see
/// `Journal::obsolete_pending`): a few µs.
const OBSOLETE_STEP_ENTRIES: usize = 64;

/// Index entries [`Journal::maintain`] reads at most per call while a
/// count is unfinished: about 25 µs, so that a caller on a 5 ms timer
/// counts a 16 MiB segment's quarter of a million ids in about 5 s with no
/// pause a client would see.
const MAINTAIN_STEP_ENTRIES: usize = 256;

/// What an obsolescence check follows.
#[derive(Clone, Copy)]
enum Check<'a> {
    /// `pid`'s coverage (the higher of its snapshot's sequence number and
    /// its deletion marker) rose from `from` to `to`: each sealed segment
    /// holding it counts one uncovered id less if its entry just became
    /// covered; unfinished counts go on, [`OBSOLETE_COUNT_ENTRIES`] each.
    Covered {
        pid: &'a PersistenceId,
        from: SequenceNr,
        to: SequenceNr,
    },
    /// Unfinished counts go on, this many entries each.
    Step(usize),
}

/// The obsolescence state of one sealed segment (read in place from its
/// index file): its entries before byte `counted` were counted, and
/// `uncovered` of them have events not all deleted or covered by a
/// snapshot. Coverage only grows (deletions and snapshot sequence numbers
/// never go down), so an entry found covered stays so; an uncovered one
/// counted is taken off when its id's coverage passes its last event
/// ([`Check::Covered`]). The segment is obsolete once every entry is
/// counted and none is uncovered: each entry is read once in the segment's
/// life, and a snapshot costs one lookup per sealed segment. (Before, a
/// first check listed every uncovered id, 8 bytes each and a pause of
/// tens of ms at a million ids; and a walk that stopped at the first
/// uncovered entry had all the covered ones after it to read when it was
/// covered last.)
#[derive(Clone, Copy)]
struct ObsoleteScan {
    counted: u32,
    uncovered: u32,
    /// Its index file turned out damaged: the segment is kept.
    broken: bool,
}

/// The single writer of one journal directory.
///
/// ```text
///  appending thread                      sync thread
///  ---------------                       -----------
///  append(): encode, CRC32C, memcpy      fdatasync(segment) per tick / doorbell
///  into the mmap'd segment,     --LSN-->  publish durable_lsn, wake waiters,
///  store written_lsn                      run on_durable callbacks
///  roll: take the spare segment --Roll--> sync sealed segment
///        (preallocated+prefaulted        |
///         by a helper thread)            v meta thread (in order): its .idx,
///  save_snapshot: write <snap>.tmp  ---> snapshot fsync + rename + dir fsync,
///                                        checkpoint + segment removals
/// ```
///
/// Threading: `Journal` is `Send`; all mutation takes `&mut self`, so
/// there is one appending thread. Durability is observed through
/// [`Journal::watcher`], which is `Send + Sync` and never blocks unless
/// asked to.
///
/// Invariants: LSNs are contiguous from 1; per persistence id, sequence
/// numbers strictly increase and epochs never decrease; nothing past the
/// last durable LSN is acknowledged; after any write or flush error every
/// append fails with [`AppendError::Poisoned`].
pub struct Journal {
    catalog: Catalog,
    options: JournalOptions,
    active: Active,
    next_lsn: Lsn,
    removed_up_to: Lsn,
    max_segment_epoch: WriterEpoch,
    snapshot_seqs: PidMap<SequenceNr>,
    shared: Arc<Shared>,
    tx: Sender<SyncMsg>,
    /// The meta thread's queue, for snapshots and index releases (never
    /// full: the appending thread never waits on it). Dropped at shutdown
    /// before the sync thread is told to stop, so that the meta thread
    /// ends once its queue is done.
    meta_tx: Option<Sender<MetaJob>>,
    sync_thread: Option<JoinHandle<()>>,
    spare: Option<SpareJob>,
    /// Saves so far, for unique temporary snapshot names.
    snapshot_serial: u64,
    /// The obsolescence state of each sealed segment read in place (see
    /// [`ObsoleteScan`]): 12 bytes per segment.
    obsolete_scans: std::collections::HashMap<Lsn, ObsoleteScan, foldhash::fast::RandomState>,
    /// Whether a segment's count is unfinished: appends carry it on,
    /// [`OBSOLETE_STEP_ENTRIES`] at a time, so that it ends while the
    /// journal is in use even if no snapshot comes.
    obsolete_pending: bool,
    head: Vec<u8>,
    poisoned: Option<String>,
}

/// The `fdatasync` latency of one journal's sync thread (every sync of the
/// current segment and of each sealed segment), from
/// [`Journal::flush_latency`]. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct FlushLatency(Arc<Shared>);

impl FlushLatency {
    /// A copy of the histogram, in microseconds (1 µs .. 60 s, two
    /// significant digits); empty while nothing was synced (durability
    /// `None` never syncs).
    pub fn snapshot_micros(&self) -> hdrhistogram::Histogram<u64> {
        self.0.flush_micros()
    }
}

impl std::fmt::Debug for FlushLatency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlushLatency").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("storage", &self.catalog.storage)
            .field("next_lsn", &self.next_lsn)
            .field("segments", &(self.catalog.sealed.len() + 1))
            .finish()
    }
}

fn open_io(op: impl Into<String>) -> impl FnOnce(io::Error) -> OpenError {
    let op = op.into();
    move |source| OpenError::Io { op, source }
}

impl Journal {
    /// Opens (creating when missing) the journal in `dir` with memory-mapped
    /// storage, recovers it, and starts a new segment.
    ///
    /// # Errors
    /// [`OpenError::Recovery`] when the directory is corrupt (strict mode),
    /// [`OpenError::Fenced`] when it holds segments of a higher writer
    /// epoch, [`OpenError::Io`] for I/O errors (including `ENOSPC` while
    /// preallocating the first segment), [`OpenError::InvalidOptions`].
    pub fn open(
        dir: impl AsRef<Path>,
        options: JournalOptions,
    ) -> Result<(Journal, RecoveryReport), OpenError> {
        let storage = MmapStorage::new(dir.as_ref())
            .map_err(open_io(format!("creating {}", dir.as_ref().display())))?;
        Self::open_with_storage(Arc::new(storage), options)
    }

    /// As [`Journal::open`], on any [`Storage`].
    ///
    /// # Errors
    /// As [`Journal::open`].
    pub fn open_with_storage(
        storage: Arc<dyn Storage>,
        options: JournalOptions,
    ) -> Result<(Journal, RecoveryReport), OpenError> {
        if options.segment_size_bytes < 4096 || options.segment_size_bytes > u32::MAX as u64 {
            return Err(OpenError::InvalidOptions(format!(
                "segment_size_bytes {} is outside 4096..=4294967295",
                options.segment_size_bytes
            )));
        }
        let full_scan = options.verify_all_on_open || options.recovery == RecoveryMode::Repair;
        let rec = recover(&*storage, options.recovery, full_scan, true, false)?;
        if options.writer_epoch < rec.max_segment_epoch {
            return Err(OpenError::Fenced {
                epoch: options.writer_epoch,
                highest: rec.max_segment_epoch,
            });
        }
        let mut report = rec.report;
        // Seal what recovery scanned: trim unused space, write the index,
        // drop empty segments (an empty one is always the last).
        let mut sealed = BTreeMap::new();
        for mut s in rec.segments {
            if s.has_index_file {
                sealed.insert(s.index.id, s);
                continue;
            }
            let len = s.file.get().map_or(0, |f| f.len_bytes());
            s.file = OnceLock::new();
            if s.index.records == 0 {
                storage
                    .remove(&s.name)
                    .map_err(open_io(format!("removing empty {}", s.name)))?;
                report.removed_files.push(s.name.clone());
                report.segments = report.segments.saturating_sub(1);
                continue;
            }
            if len > s.index.end_offset {
                storage
                    .truncate(&s.name, s.index.end_offset)
                    .map_err(open_io(format!("trimming {}", s.name)))?;
            }
            let idx = index_name(s.index.id);
            storage
                .write_file_durable(&idx, &s.index.encode_file())
                .map_err(open_io(format!("writing the index of {}", s.name)))?;
            s.has_index_file = true;
            // Read in place from now on, as every durable index (kept in
            // memory when the file cannot be read that way).
            if let Ok(Ok(Some(f))) = storage.map_file(&idx).map(FileIndex::new) {
                drop(s.use_file_index(f));
            }
            sealed.insert(s.index.id, s);
        }
        // The snapshot table, created when missing (its entry is made
        // durable by the directory sync below).
        let (table, table_suspect) = open_snapshot_table(&*storage, true, &rec.pids)?;
        storage
            .sync_dir()
            .map_err(open_io("syncing the journal directory"))?;

        let next_lsn = rec.next_lsn;
        let name = segment_name(next_lsn);
        // Made under a temporary name and put in place with its header
        // written, as a roll puts the spare in place: a view of this
        // directory (another core recovering a moved shard) never lists a
        // segment without its header, which it could not tell from damage.
        let tmp = format!("{name}{TMP_SUFFIX}");
        let file = storage
            .create_segment(&tmp, options.segment_size_bytes)
            .map_err(open_io(format!("creating segment {name}")))?;
        let mut active = Active {
            name,
            file,
            size_bytes: options.segment_size_bytes,
            index: SegmentIndex::new(next_lsn, options.writer_epoch),
        };
        write_header(&mut active, options.writer_epoch)
            .map_err(open_io(format!("writing the header of {}", active.name)))?;
        storage
            .rename(&tmp, &active.name)
            .map_err(open_io(format!("putting segment {} in place", active.name)))?;

        let durable = Lsn(next_lsn.0 - 1);
        let shared = Arc::new(Shared::new(durable));
        let (tx, rx) = crossbeam_channel::bounded(64);
        let (meta_tx, meta_rx) = crossbeam_channel::unbounded();
        let thread = {
            let shared = shared.clone();
            let storage = storage.clone();
            let policy = options.durability;
            let current = active.file.syncer();
            let meta = (meta_tx.clone(), meta_rx);
            std::thread::Builder::new()
                .name("journal-sync".into())
                .spawn(move || sync::run(rx, shared, storage, policy, current, meta))
                .map_err(open_io("starting the sync thread"))?
        };
        let mut journal = Journal {
            catalog: Catalog {
                storage,
                sealed,
                pids: rec.pids,
                deleted: rec.deleted,
                snapshot_files: rec.snapshot_files.into_iter().collect(),
                snapshot_names: Default::default(),
                pending_snapshots: Default::default(),
                table,
                table_suspect,
            },
            max_segment_epoch: rec.max_segment_epoch.max(options.writer_epoch),
            options,
            active,
            next_lsn,
            removed_up_to: rec.removed_up_to,
            snapshot_seqs: PidMap::default(),
            shared,
            tx,
            meta_tx: Some(meta_tx),
            sync_thread: Some(thread),
            spare: None,
            snapshot_serial: 0,
            obsolete_scans: Default::default(),
            obsolete_pending: false,
            head: Vec::with_capacity(128),
            poisoned: None,
        };
        journal.start_spare();
        Ok((journal, report))
    }

    fn start_spare(&mut self) {
        let storage = self.catalog.storage.clone();
        let name = format!("spare-{:020}{TMP_SUFFIX}", self.active.index.id.0);
        let size = self.options.segment_size_bytes;
        self.spare = std::thread::Builder::new()
            .name("journal-prealloc".into())
            .spawn(move || {
                crate::storage::lower_thread_priority();
                storage.create_segment(&name, size).map(|f| (name, f))
            })
            .ok();
    }

    /// The policy this journal was opened with.
    pub fn durability(&self) -> Durability {
        self.options.durability
    }

    /// A handle on this journal's `fdatasync` latency histogram, readable
    /// from any thread (for metrics).
    pub fn flush_latency(&self) -> FlushLatency {
        FlushLatency(self.shared.clone())
    }

    /// A handle to observe durability (poll, block, or callback).
    pub fn watcher(&self) -> DurabilityWatcher {
        DurabilityWatcher::new(
            self.shared.clone(),
            self.tx.clone(),
            self.options.durability,
        )
    }

    /// The highest durable LSN. Never blocks.
    pub fn durable_lsn(&self) -> Lsn {
        Lsn(self.shared.durable_lsn.load(Ordering::SeqCst))
    }

    /// The LSN the next append gets.
    pub fn next_lsn(&self) -> Lsn {
        self.next_lsn
    }

    /// Blocks until `lsn` is durable (asking for a flush under
    /// [`Durability::None`]).
    ///
    /// # Errors
    /// [`DurabilityError::Poisoned`] when a flush failed first.
    pub fn wait_durable(&self, lsn: Lsn) -> Result<(), DurabilityError> {
        if lsn.0 >= self.next_lsn.0 {
            return Err(DurabilityError::Closed { lsn });
        }
        self.watcher().wait_durable(lsn)
    }

    /// Asks the sync thread to flush everything appended so far, without
    /// waiting.
    pub fn request_flush(&self) {
        sync::ring(&self.shared, &self.tx);
    }

    /// The highest event sequence number of `pid` (0 when none).
    pub fn highest_sequence_nr(&self, pid: &PersistenceId) -> SequenceNr {
        self.catalog
            .pids
            .get(pid.as_str())
            .map_or(SequenceNr(0), |s| s.last_seq)
    }

    /// The persistence id `id` as this journal holds it (its own copy,
    /// shared: a clone, no allocation), when it has records of it.
    pub fn persistence_id(&self, id: &str) -> Option<PersistenceId> {
        self.catalog.pids.get_key_value(id).map(|(p, _)| p.clone())
    }

    /// The highest writer epoch recorded for `pid` (0 when none).
    pub fn writer_epoch_of(&self, pid: &PersistenceId) -> WriterEpoch {
        self.catalog
            .pids
            .get(pid.as_str())
            .map_or(WriterEpoch(0), |s| s.max_epoch)
    }

    fn check_poison(&mut self) -> Result<(), String> {
        if let Some(r) = &self.poisoned {
            return Err(r.clone());
        }
        if self.shared.poisoned.load(Ordering::SeqCst) {
            let r = self
                .shared
                .poison_reason()
                .unwrap_or_else(|| "flush failed".into());
            self.poisoned = Some(r.clone());
            return Err(r);
        }
        Ok(())
    }

    fn poison(&mut self, reason: String) {
        self.poisoned = Some(reason.clone());
        self.shared.poison(reason);
    }

    /// Appends one event and returns its LSN. Never blocks on a flush; it
    /// blocks only when a segment fills and the next one is not prepared
    /// yet.
    ///
    /// # Errors
    /// [`AppendError::Poisoned`] after any earlier write or flush error;
    /// [`AppendError::Fenced`] when `epoch` is below the id's highest;
    /// [`AppendError::SequenceNotIncreasing`] when `sequence_nr` is 0 or
    /// not above the id's last; [`AppendError::TooLarge`];
    /// [`AppendError::SegmentAllocation`] when a new segment cannot be
    /// preallocated (not poisoned); [`AppendError::Io`] when the write
    /// fails (poisoned).
    pub fn append(
        &mut self,
        pid: &PersistenceId,
        sequence_nr: SequenceNr,
        epoch: WriterEpoch,
        payload: &[u8],
    ) -> Result<Lsn, AppendError> {
        // One hash of the id for every map it is looked up in (they share
        // `PidHash`); a writer's id is the journal's own copy, so each
        // comparison is a pointer comparison.
        let hash = pid_hash(pid.as_str());
        let (last, highest) = self
            .catalog
            .pids
            .get_pid(hash, pid)
            .map_or((SequenceNr(0), WriterEpoch(0)), |s| {
                (s.last_seq, s.max_epoch)
            });
        if epoch < highest {
            return Err(AppendError::Fenced {
                persistence_id: pid.clone(),
                epoch,
                highest,
            });
        }
        if sequence_nr <= last {
            return Err(AppendError::SequenceNotIncreasing {
                persistence_id: pid.clone(),
                sequence_nr,
                last,
            });
        }
        self.write_record(pid, hash, sequence_nr, epoch, RecordKind::Event, payload)
    }

    /// Deletes `pid`'s events up to `to` (capped at its last sequence
    /// number) by appending a deletion marker. Returns the marker's LSN, or
    /// `None` when nothing new is deleted. Segments whose records are all
    /// deleted or covered by snapshots are removed by the journal's meta thread.
    ///
    /// # Errors
    /// As [`Journal::append`] (except `SequenceNotIncreasing`).
    pub fn delete_to(
        &mut self,
        pid: &PersistenceId,
        to: SequenceNr,
        epoch: WriterEpoch,
    ) -> Result<Option<Lsn>, AppendError> {
        let Some(st) = self.catalog.pids.get(pid.as_str()).copied() else {
            return Ok(None);
        };
        if epoch < st.max_epoch {
            return Err(AppendError::Fenced {
                persistence_id: pid.clone(),
                epoch,
                highest: st.max_epoch,
            });
        }
        let to = to.min(st.last_seq);
        let deleted = self.catalog.deleted_to(pid.as_str());
        if to <= deleted {
            return Ok(None);
        }
        let snap = self
            .snapshot_seqs
            .get(pid.as_str())
            .copied()
            .unwrap_or_default();
        let lsn = self.write_record(
            pid,
            pid_hash(pid.as_str()),
            to,
            epoch,
            RecordKind::Deletion,
            &[],
        )?;
        self.remove_obsolete_segments(Check::Covered {
            pid,
            from: deleted.max(snap),
            to: to.max(snap),
        })?;
        Ok(Some(lsn))
    }

    /// Writes one record of `pid` (`hash`: its [`pid_hash`]).
    fn write_record(
        &mut self,
        pid: &PersistenceId,
        hash: u64,
        seq: SequenceNr,
        epoch: WriterEpoch,
        kind: RecordKind,
        payload: &[u8],
    ) -> Result<Lsn, AppendError> {
        self.check_poison()
            .map_err(|reason| AppendError::Poisoned { reason })?;
        let len = record_len_bytes(pid.as_bytes().len(), payload.len());
        let max = self.active.size_bytes - format::SEGMENT_HEADER_LEN_BYTES as u64;
        if len > max {
            return Err(AppendError::TooLarge {
                len_bytes: len,
                max_bytes: max,
            });
        }
        if self.active.index.end_offset + len > self.active.size_bytes {
            self.roll()?;
        }
        let lsn = self.next_lsn;
        let fields = RecordFields {
            lsn,
            sequence_nr: seq,
            writer_epoch: epoch,
            timestamp_ms: now_ms(),
            kind,
            persistence_id: pid.as_bytes(),
        };
        encode_record_head(&fields, payload, &mut self.head);
        let off = self.active.index.end_offset;
        let r = self.active.file.write_at(off, &self.head).and_then(|()| {
            self.active
                .file
                .write_at(off + self.head.len() as u64, payload)
        });
        if let Err(source) = r {
            self.poison(format!("write to {} failed: {source}", self.active.name));
            return Err(AppendError::Io { source });
        }
        self.active
            .index
            .add(pid, hash, kind, seq, epoch, lsn, off, len);
        let st = self
            .catalog
            .pids
            .get_or_insert_with(hash, pid, PidState::default);
        st.max_epoch = st.max_epoch.max(epoch);
        match kind {
            RecordKind::Event => st.last_seq = seq,
            RecordKind::Deletion => raise_deleted(&mut self.catalog.deleted, pid, seq),
        }
        self.next_lsn = Lsn(lsn.0 + 1);
        // Release: the record's bytes (and a roll sent before them) are
        // visible to the sync thread once it loads this LSN; a SeqCst store
        // is a full fence per record on x86 and orders nothing more here
        // (the doorbell's swap orders the `Always` ring).
        self.shared.written_lsn.store(lsn.0, Ordering::Release);
        if self.options.durability == Durability::Always {
            sync::ring(&self.shared, &self.tx);
        }
        // After the store: a removal queued here waits for this LSN to be
        // durable, which the sync thread learns from `written_lsn`.
        self.adopt_file_indexes();
        if self.obsolete_pending && kind == RecordKind::Event {
            // This record is written: a failure to queue a removal
            // poisons the journal for the next call, not this one. (A
            // deletion marker's own check follows it: counted now, its
            // id's entries would be counted covered and then taken off
            // again as just covered.)
            let _ = self.remove_obsolete_segments(Check::Step(OBSOLETE_STEP_ENTRIES));
        }
        Ok(lsn)
    }

    /// What appends do on the way, for a journal that may be idle: reads
    /// the indexes of sealed segments whose index file the meta thread
    /// made durable from those files from now on (the in-memory indexes
    /// they replace are freed on the meta thread), and carries unfinished
    /// obsolescence counts on by up to 256 index entries each (so that
    /// segments whose every id is covered by a snapshot or deleted are
    /// removed without waiting for more appends). Without it, an idle
    /// journal kept its newest sealed segment's in-memory index (about 70
    /// bytes per id it holds) until its next append. Call it on a timer
    /// (the engine's data core does, every 5 ms); a load of a flag and a
    /// check when there is nothing to do. A failure to queue a removal
    /// poisons the journal for the next call, as after an append.
    pub fn maintain(&mut self) {
        if self.check_poison().is_err() {
            return;
        }
        self.adopt_file_indexes();
        if self.obsolete_pending {
            let _ = self.remove_obsolete_segments(Check::Step(MAINTAIN_STEP_ENTRIES));
        }
    }

    /// Reads the indexes of sealed segments whose index file the meta
    /// thread made durable (and offered) from those files from now on; the
    /// in-memory indexes they replace are freed on the meta thread. One
    /// load of a flag when there are none (on every append).
    fn adopt_file_indexes(&mut self) {
        if !self.shared.file_indexes_ready.load(Ordering::Relaxed) {
            return;
        }
        for (id, f) in self.shared.take_file_indexes() {
            let Some(s) = self.catalog.sealed.get_mut(&id) else {
                continue;
            };
            if s.file_index.is_none() {
                let old = s.use_file_index(f);
                // The meta thread gone, the index is freed here instead.
                if let Some(meta) = &self.meta_tx {
                    let _ = meta.send(MetaJob::Release(old));
                }
                // Its ids are counted from now on (appends carry it on).
                self.obsolete_pending = true;
            }
        }
    }

    fn roll(&mut self) -> Result<(), AppendError> {
        let spare = match self.spare.take() {
            Some(job) => job
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("preallocation thread panicked"))),
            None => Err(io::Error::other("no spare segment")),
        };
        let (spare_name, spare) = match spare {
            Ok(f) => f,
            Err(source) => {
                self.start_spare();
                return Err(AppendError::SegmentAllocation { source });
            }
        };
        let id = self.next_lsn;
        let name = segment_name(id);
        let mut next = Active {
            name: name.clone(),
            file: spare,
            size_bytes: self.options.segment_size_bytes,
            index: SegmentIndex::new(id, self.options.writer_epoch),
        };
        let r = write_header(&mut next, self.options.writer_epoch)
            .and_then(|()| self.catalog.storage.rename(&spare_name, &name));
        if let Err(source) = r {
            self.poison(format!("creating segment {name} failed: {source}"));
            return Err(AppendError::Io { source });
        }
        let old = std::mem::replace(&mut self.active, next);
        let index = Arc::new(old.index);
        let msg = SyncMsg::Roll {
            sealed: old.file.syncer(),
            index_name: index_name(index.id),
            index: index.clone(),
            next: self.active.file.syncer(),
        };
        if self.tx.send(msg).is_err() {
            let reason = self
                .shared
                .poison_reason()
                .unwrap_or_else(|| "sync thread stopped".into());
            self.poison(reason.clone());
            return Err(AppendError::Poisoned { reason });
        }
        let sealed = SealedSegment {
            name: old.name,
            index,
            file_index: None,
            has_index_file: true,
            file: OnceLock::from(old.file),
        };
        self.catalog.sealed.insert(sealed.index.id, sealed);
        self.start_spare();
        self.remove_obsolete_segments(Check::Step(OBSOLETE_COUNT_ENTRIES))?;
        Ok(())
    }

    /// Follows `check` (see [`ObsoleteScan`]) and removes the sealed
    /// segments found obsolete: every event deleted or covered by a
    /// snapshot. A segment is followed once its index file is durable and
    /// read in place (until then it is the newest sealed segment or close
    /// to it); one whose index file turned out damaged is kept.
    fn remove_obsolete_segments(&mut self, check: Check<'_>) -> Result<(), AppendError> {
        self.adopt_file_indexes();
        let covered = |p: &str, e: &EntryRef<'_>| {
            if e.has_no_events() {
                return true;
            }
            let snap = self.snapshot_seqs.get(p).copied().unwrap_or_default();
            e.last_event_seq() <= self.catalog.deleted_to(p).max(snap)
        };
        let budget = match check {
            Check::Covered { .. } => OBSOLETE_COUNT_ENTRIES,
            Check::Step(n) => n,
        };
        let mut doomed = Vec::new();
        let mut pending = false;
        for (id, s) in &self.catalog.sealed {
            let Some(fi) = &s.file_index else {
                continue;
            };
            let scan = self.obsolete_scans.entry(*id).or_insert(ObsoleteScan {
                counted: format::INDEX_ENTRIES_AT as u32,
                uncovered: 0,
                broken: false,
            });
            if scan.broken {
                continue;
            }
            if let Check::Covered { pid, from, to } = check {
                match fi.get_at(pid.as_str()) {
                    Ok(Some((at, e))) => {
                        let last = e.last_event_seq;
                        if at < scan.counted && e.event_count() > 0 && from < last && last <= to {
                            scan.uncovered = scan.uncovered.saturating_sub(1);
                        }
                    }
                    Ok(None) => {}
                    Err(_) => {
                        scan.broken = true;
                        continue;
                    }
                }
            }
            if scan.counted < fi.entries_end() {
                match fi.count_uncovered(scan.counted as usize, budget, |p, e| covered(p, &e)) {
                    Ok((next, n)) => {
                        scan.counted = next;
                        scan.uncovered += n;
                    }
                    Err(_) => {
                        scan.broken = true;
                        continue;
                    }
                }
            }
            if scan.counted < fi.entries_end() {
                pending = true;
            } else if scan.uncovered == 0 {
                doomed.push(*id);
            }
        }
        self.obsolete_pending = pending;
        for id in &doomed {
            self.obsolete_scans.remove(id);
        }
        if doomed.is_empty() {
            return Ok(());
        }
        let mut segments = Vec::new();
        for id in doomed {
            if let Some(s) = self.catalog.sealed.remove(&id) {
                self.removed_up_to = self.removed_up_to.max(s.index.last_lsn);
                segments.push((id, s.name.clone()));
            }
        }
        // The checkpoint is the meta thread's to make, from the previous
        // one and these segments' index files (see `sync::RemoveJob`).
        let job = RemoveJob {
            segments,
            max_segment_epoch: self.max_segment_epoch,
            removed_up_to: self.removed_up_to,
            written: Lsn(self.next_lsn.0 - 1),
        };
        if self.tx.send(SyncMsg::Remove(job)).is_err() {
            let reason = "sync thread stopped".to_string();
            self.poison(reason.clone());
            return Err(AppendError::Poisoned { reason });
        }
        Ok(())
    }

    /// Calls `f` for each event of `pid` with a sequence number at least
    /// `from`, in order, skipping deleted events. Uses the segment indexes:
    /// only segments holding `pid` are read. Returns the number of events.
    ///
    /// # Errors
    /// [`ReplayError::Corrupt`] naming segment and offset when a record on
    /// the way fails its checks; [`ReplayError::Io`].
    pub fn replay_with(
        &self,
        pid: &PersistenceId,
        from: SequenceNr,
        mut f: impl FnMut(&RecordView<'_>),
    ) -> Result<u64, ReplayError> {
        let Some(from) = self.catalog.start_seq(pid, from) else {
            return Ok(0);
        };
        let mut n = self.catalog.replay_sealed(pid, from, &mut f)?;
        if let Some(e) = self.active.index.pids.get(pid.as_str()) {
            let view = self.active.file.view();
            let e = EntryRef::Memory(e, SequenceNr(0));
            let id = self.active.index.id;
            n += Catalog::replay_segment(&self.active.name, id, e, &view, pid, from, &mut f)?;
        }
        Ok(n)
    }

    /// As [`Journal::replay_with`], collecting owned records.
    ///
    /// # Errors
    /// As [`Journal::replay_with`].
    pub fn replay(
        &self,
        pid: &PersistenceId,
        from: SequenceNr,
    ) -> Result<Vec<Record>, ReplayError> {
        let mut out = Vec::new();
        self.replay_with(pid, from, |r| out.push(Record::from_view(r, pid)))?;
        Ok(out)
    }

    /// The latest snapshot of `pid` and the events after it.
    ///
    /// # Errors
    /// [`ReplayError`] from replaying; a snapshot that cannot be loaded is
    /// reported as [`ReplayError::Io`] with kind `InvalidData`.
    pub fn recover(&self, pid: &PersistenceId) -> Result<Recovery, ReplayError> {
        self.catalog.recover(
            pid,
            |from| self.replay(pid, from),
            || self.highest_sequence_nr(pid),
        )
    }

    /// Saves `data` as the latest snapshot of `pid` at `sequence_nr`,
    /// replacing any older one. The caller's thread only encodes it (no
    /// file I/O: on a data core a file's creation and write cost more than
    /// the events it covers); the journal's meta thread writes it: to the
    /// id's slot pair in the snapshot table when the encoding fits a slot
    /// (at most [`format::TABLE_SNAPSHOT_MAX_BYTES`]), made durable by the
    /// table's next sync (one per 10 ms batch of saves), else to a
    /// temporary file that it makes durable (`fsync`), renames into place
    /// and whose directory it syncs (FORMAT.md, "Snapshot table" and
    /// "Snapshot file").
    /// Until then the previous snapshot file and every event stay on disk:
    /// segments that the new snapshot makes obsolete are removed only after
    /// it is durable (the removal is queued behind it), so a crash at any
    /// point loses nothing that was durable. This journal reads the new
    /// snapshot at once ([`Journal::recover`]); readers of the directory
    /// see it once it is durable. A failure to make it durable poisons the
    /// journal, reported like a failed flush: every later append fails and
    /// every durability wait gets [`DurabilityError::Poisoned`] (so does a
    /// failure to write the temporary file: the segments it made obsolete
    /// are then kept).
    ///
    /// # Errors
    /// [`SnapshotError::Fenced`] for a stale epoch;
    /// [`SnapshotError::BadSequenceNr`] when `sequence_nr` is above the id's
    /// last event or below the saved snapshot's; [`SnapshotError::Poisoned`]
    /// when the journal is poisoned or its sync thread stopped.
    pub fn save_snapshot(
        &mut self,
        pid: &PersistenceId,
        sequence_nr: SequenceNr,
        epoch: WriterEpoch,
        data: &[u8],
    ) -> Result<(), SnapshotError> {
        self.check_poison()
            .map_err(|reason| SnapshotError::Poisoned { reason })?;
        let st = self
            .catalog
            .pids
            .get(pid.as_str())
            .copied()
            .unwrap_or_default();
        if epoch < st.max_epoch {
            return Err(SnapshotError::Fenced {
                persistence_id: pid.clone(),
                epoch,
                highest: st.max_epoch,
            });
        }
        if sequence_nr > st.last_seq {
            return Err(SnapshotError::BadSequenceNr {
                persistence_id: pid.clone(),
                sequence_nr,
                reason: "above the last event's sequence number",
            });
        }
        let saved = match self.snapshot_seqs.get(pid.as_str()) {
            Some(s) => Some(*s),
            None => self.catalog.load_snapshot(pid)?.map(|s| s.sequence_nr),
        };
        if saved.is_some_and(|s| s > sequence_nr) {
            return Err(SnapshotError::BadSequenceNr {
                persistence_id: pid.clone(),
                sequence_nr,
                reason: "below the saved snapshot's sequence number",
            });
        }
        let snap = Snapshot {
            persistence_id: pid.clone(),
            sequence_nr,
            writer_epoch: epoch,
            timestamp_ms: now_ms(),
            data: data.to_vec(),
        };
        let encoded = snap.encode();
        let fits = encoded.len() <= format::TABLE_SNAPSHOT_MAX_BYTES;
        if let Some(table) = self.catalog.table.clone().filter(|_| fits) {
            // A slot of the table: no file, and the meta thread's one sync
            // covers a batch of saves.
            let key = table_key(pid);
            return self.queue_snapshot(pid, sequence_nr, key, String::new(), encoded, Some(table));
        }
        let name = match self
            .catalog
            .snapshot_names
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(pid.as_str())
        {
            Some(n) => n.clone(),
            None => {
                let hash = snapshot_hash(pid);
                let mut k = 0u32;
                loop {
                    let n = format!("{hash}-{k}{SNAPSHOT_SUFFIX}");
                    if !self.catalog.snapshot_files.contains(&n) {
                        break n;
                    }
                    k += 1;
                }
            }
        };
        // A fresh temporary name per save. The meta thread writes and renames
        // saves in order, so this is no longer needed for correctness (it was
        // when this thread wrote the file while an earlier save waited).
        self.snapshot_serial += 1;
        let tmp = format!("{name}.{}{TMP_SUFFIX}", self.snapshot_serial);
        self.catalog.snapshot_files.insert(name.clone());
        self.catalog
            .snapshot_names
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(pid.clone(), name.clone());
        self.queue_snapshot(pid, sequence_nr, name, tmp, encoded, None)
    }

    /// Queues the save of snapshot encoding `encoded` of `pid` at
    /// `sequence_nr` for the meta thread (readable from the pending
    /// snapshots under `name` until it is durable: a file written to `tmp`
    /// and put in place as `name`, or with `table` a slot of the table),
    /// then removes the segments it makes obsolete (queued behind it, so
    /// only once it is durable).
    fn queue_snapshot(
        &mut self,
        pid: &PersistenceId,
        sequence_nr: SequenceNr,
        name: String,
        tmp: String,
        encoded: Vec<u8>,
        table: Option<Arc<SnapshotTable>>,
    ) -> Result<(), SnapshotError> {
        let bytes = Arc::new(encoded);
        self.catalog
            .pending_snapshots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.clone(), bytes.clone());
        let msg = MetaJob::Snapshot {
            tmp,
            name,
            bytes,
            pending: self.catalog.pending_snapshots.clone(),
            table: table.map(|t| (t, pid.clone())),
        };
        let sent = self.meta_tx.as_ref().is_some_and(|m| m.send(msg).is_ok());
        if !sent {
            let reason = "the journal's meta thread stopped".to_string();
            self.poison(reason.clone());
            return Err(SnapshotError::Poisoned { reason });
        }
        let before = self
            .snapshot_seqs
            .insert(pid.clone(), sequence_nr)
            .unwrap_or_default();
        let deleted = self.catalog.deleted_to(pid.as_str());
        self.remove_obsolete_segments(Check::Covered {
            pid,
            from: before.max(deleted),
            to: sequence_nr.max(deleted),
        })
        .map_err(|e| SnapshotError::Poisoned {
            reason: e.to_string(),
        })?;
        Ok(())
    }

    /// Loads the latest snapshot of `pid`.
    ///
    /// # Errors
    /// [`SnapshotError::Corrupt`] for a damaged file; [`SnapshotError::Io`].
    pub fn load_snapshot(&self, pid: &PersistenceId) -> Result<Option<Snapshot>, SnapshotError> {
        self.catalog.load_snapshot(pid)
    }

    /// Number of segment files (sealed plus the open one).
    pub fn segment_count(&self) -> usize {
        self.catalog.sealed.len() + 1
    }

    /// Flushes everything appended, stops the sync thread and closes.
    ///
    /// # Errors
    /// [`CloseError::Poisoned`] when the journal is poisoned or the final
    /// flush failed: records after [`Journal::durable_lsn`] may be lost.
    pub fn close(mut self) -> Result<(), CloseError> {
        self.shutdown();
        match self.check_poison() {
            Ok(()) => Ok(()),
            Err(reason) => Err(CloseError::Poisoned { reason }),
        }
    }

    fn shutdown(&mut self) {
        if let Some(t) = self.sync_thread.take() {
            drop(self.meta_tx.take());
            let _ = self.tx.send(SyncMsg::Shutdown);
            let _ = t.join();
        }
        if let Some(job) = self.spare.take() {
            if let Ok(Ok((name, f))) = job.join() {
                drop(f);
                let _ = self.catalog.storage.remove(&name);
            }
        }
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The replay error for sealed segment `s` whose index file, read in
/// place, failed with `reason`.
fn index_damage(s: &SealedSegment, reason: format::FileDecodeError) -> ReplayError {
    let offset = match reason {
        format::FileDecodeError::Malformed(at) => at,
        _ => 0,
    };
    ReplayError::Corrupt {
        segment: s.index.id,
        file: index_name(s.index.id),
        offset,
        kind: CorruptionKind::IndexFile(reason),
    }
}

fn snapshot_to_replay(e: SnapshotError) -> ReplayError {
    match e {
        SnapshotError::Io { op, source } => ReplayError::Io { op, source },
        other => ReplayError::Io {
            op: "loading the snapshot".into(),
            source: io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
        },
    }
}

fn write_header(active: &mut Active, epoch: WriterEpoch) -> io::Result<()> {
    let h = SegmentHeader {
        segment_id: active.index.id,
        writer_epoch: epoch,
        segment_size_bytes: active.size_bytes,
        created_ms: now_ms(),
    };
    active.file.write_at(0, &h.encode())
}

// ----------------------------------------------------------- the reader

/// A read-only view of a journal directory, possibly one another writer is
/// appending to (for example when a shard moves between cores). It sees
/// the records present when it was opened; nothing is changed on disk: a
/// torn tail is reported, not cut. Bad bytes in the newest segment are taken
/// for the live writer's record in progress and end the view there (reported
/// as a torn tail); bad bytes in an older segment fail the open.
pub struct JournalReader {
    catalog: Catalog,
    report: RecoveryReport,
    /// The LSN after the last record it read (see [`Earlier::seen_up_to`]).
    next_lsn: Lsn,
    /// See [`Earlier::read`].
    read: BTreeMap<Lsn, crate::recovery::Seen>,
    /// See [`Earlier::removed_up_to`].
    removed_up_to: Lsn,
}

impl std::fmt::Debug for JournalReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JournalReader")
            .field("storage", &self.catalog.storage)
            .field("segments", &self.catalog.sealed.len())
            .finish()
    }
}

impl JournalReader {
    /// Opens `dir` read-only with memory-mapped storage.
    ///
    /// # Errors
    /// [`OpenError::Recovery`] when the directory is corrupt;
    /// [`OpenError::Io`] when it does not exist or cannot be read.
    pub fn open(dir: impl AsRef<Path>) -> Result<JournalReader, OpenError> {
        let storage = MmapStorage::existing(dir.as_ref())
            .map_err(open_io(format!("opening {}", dir.as_ref().display())))?;
        Self::open_with_storage(Arc::new(storage))
    }

    /// As [`JournalReader::open`], on any [`Storage`].
    ///
    /// # Errors
    /// As [`JournalReader::open`].
    pub fn open_with_storage(storage: Arc<dyn Storage>) -> Result<JournalReader, OpenError> {
        let rec = recover(&*storage, RecoveryMode::Strict, false, false, true)?;
        let (table, table_suspect) = open_snapshot_table(&*storage, false, &rec.pids)?;
        Ok(Self::from_recovered(storage, rec, table, table_suspect))
    }

    fn from_recovered(
        storage: Arc<dyn Storage>,
        rec: crate::recovery::Recovered,
        table: Option<Arc<SnapshotTable>>,
        table_suspect: bool,
    ) -> JournalReader {
        let read = rec
            .segments
            .iter()
            .map(|s| (s.index.id, crate::recovery::Seen::of(s)))
            .collect();
        let removed_up_to = rec.removed_up_to;
        let sealed = rec.segments.into_iter().map(|s| (s.index.id, s)).collect();
        JournalReader {
            read,
            removed_up_to,
            catalog: Catalog {
                storage,
                sealed,
                pids: rec.pids,
                deleted: rec.deleted,
                snapshot_files: rec.snapshot_files.into_iter().collect(),
                snapshot_names: Default::default(),
                pending_snapshots: Default::default(),
                table,
                table_suspect,
            },
            report: rec.report,
            next_lsn: rec.next_lsn,
        }
    }

    /// This view brought up to what the directory holds now, reading only
    /// what changed since it was opened or last refreshed: the sealed
    /// segments it read through their index files are kept as they are
    /// (those still there), and only newer segments, the ones it had to
    /// scan (the live writer's newest among them) and the snapshot table's
    /// pairs from its first unfinished one on are read; the checkpoint's
    /// per-id state only when a segment it never read was removed. What it
    /// answers afterwards is what [`JournalReader::open`] of the directory
    /// would answer now. It reads the directory afresh when it no longer
    /// holds what this view read: a segment read before with another
    /// header (made again), the last bytes of the records it scanned
    /// changed (cut, or written over), a segment gone that the checkpoint
    /// does not cover, a checkpoint gone back, or fewer records. Opening
    /// again read
    /// everything: 0.35-0.75 s for a million ids, on the data core that
    /// recovers an entity whose shard came from another core.
    ///
    /// # Errors
    /// As [`JournalReader::open`]; the view is gone then (open a new one).
    pub fn refresh(self) -> Result<JournalReader, OpenError> {
        let JournalReader {
            catalog,
            next_lsn,
            read,
            removed_up_to,
            ..
        } = self;
        let Catalog {
            storage,
            sealed,
            pids,
            deleted,
            table,
            table_suspect: _,
            ..
        } = catalog;
        let earlier = Earlier {
            segments: sealed,
            pids,
            deleted,
            seen_up_to: Lsn(next_lsn.0.saturating_sub(1)),
            read,
            removed_up_to,
        };
        let rec = recover_with(
            &*storage,
            RecoveryMode::Strict,
            false,
            false,
            true,
            Some(earlier),
        )?;
        let (table, suspect) = match table {
            Some(t) => {
                let scan = t
                    .scan_new_pairs(|p| rec.pids.get_key_value(p.as_str()).map(|(k, _)| k.clone()))
                    .map_err(open_io("reading the snapshot table"))?;
                (Some(t), scan.unreadable_slots > 0)
            }
            None => open_snapshot_table(&*storage, false, &rec.pids)?,
        };
        if rec.replaced || rec.next_lsn < next_lsn {
            // Not what it read before (replaced, or cut): nothing of before
            // can be kept.
            return JournalReader::open_with_storage(storage);
        }
        // The scan read again every pair with an unreadable slot: what it
        // found is the table's state now (a write seen half done before
        // no longer counts).
        Ok(Self::from_recovered(storage, rec, table, suspect))
    }

    /// What recovery found.
    pub fn report(&self) -> &RecoveryReport {
        &self.report
    }

    /// The persistence ids known, sorted.
    pub fn persistence_ids(&self) -> Vec<PersistenceId> {
        let mut v: Vec<_> = self.catalog.pids.keys().cloned().collect();
        v.sort();
        v
    }

    /// The highest event sequence number of `pid` (0 when none).
    pub fn highest_sequence_nr(&self, pid: &PersistenceId) -> SequenceNr {
        self.catalog
            .pids
            .get(pid.as_str())
            .map_or(SequenceNr(0), |s| s.last_seq)
    }

    /// As [`Journal::replay_with`].
    ///
    /// # Errors
    /// As [`Journal::replay_with`].
    pub fn replay_with(
        &self,
        pid: &PersistenceId,
        from: SequenceNr,
        mut f: impl FnMut(&RecordView<'_>),
    ) -> Result<u64, ReplayError> {
        let Some(from) = self.catalog.start_seq(pid, from) else {
            return Ok(0);
        };
        self.catalog.replay_sealed(pid, from, &mut f)
    }

    /// As [`Journal::replay`].
    ///
    /// # Errors
    /// As [`Journal::replay_with`].
    pub fn replay(
        &self,
        pid: &PersistenceId,
        from: SequenceNr,
    ) -> Result<Vec<Record>, ReplayError> {
        let mut out = Vec::new();
        self.replay_with(pid, from, |r| out.push(Record::from_view(r, pid)))?;
        Ok(out)
    }

    /// As [`Journal::load_snapshot`].
    ///
    /// # Errors
    /// As [`Journal::load_snapshot`].
    pub fn load_snapshot(&self, pid: &PersistenceId) -> Result<Option<Snapshot>, SnapshotError> {
        self.catalog.load_snapshot(pid)
    }

    /// As [`Journal::recover`].
    ///
    /// # Errors
    /// As [`Journal::recover`].
    pub fn recover(&self, pid: &PersistenceId) -> Result<Recovery, ReplayError> {
        self.catalog.recover(
            pid,
            |from| self.replay(pid, from),
            || self.highest_sequence_nr(pid),
        )
    }
}
