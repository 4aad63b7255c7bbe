//! The sync thread and the durability watcher.
//!
//! The appending thread never flushes. It publishes the highest LSN it has
//! written (`written_lsn`) and, under `Always`, rings a doorbell. The sync
//! thread owns every `fdatasync`: it reads `written_lsn`, then drains its
//! channel (segment rolls, index files, segment removals, doorbells), then
//! syncs the current segment and publishes `durable_lsn`. Reading
//! `written_lsn` *before* draining makes a roll visible before any LSN of
//! the new segment is declared durable: the writer sends the roll before it
//! writes the new segment's first record.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};

use crate::ids::{Lsn, PersistenceId, WriterEpoch};
use crate::storage::{SegmentSync, Storage};
use crate::table::SnapshotTable;
use crate::Durability;

/// Why an LSN will never become durable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DurabilityError {
    /// A flush or write failed; the journal is poisoned and nothing after
    /// the last durable LSN will ever be acknowledged.
    #[error("journal is poisoned: {reason}")]
    Poisoned {
        /// The failed operation and its OS error.
        reason: String,
    },
    /// The journal was closed, or the LSN was never written.
    #[error("journal closed before LSN {lsn} was written")]
    Closed {
        /// The LSN waited for.
        lsn: Lsn,
    },
}

/// A callback run once an LSN is durable or will never be.
pub type DurableCallback = Box<dyn FnOnce(Result<Lsn, DurabilityError>) + Send + 'static>;

#[derive(Default)]
struct WaitState {
    poisoned: Option<String>,
    closed: bool,
    callbacks: BTreeMap<u64, Vec<DurableCallback>>,
}

/// A histogram for `fdatasync` latencies: 1 µs .. 60 s, 2 significant
/// digits.
fn new_flush_histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 2)
        .expect("constant histogram bounds are valid")
}

/// State shared by the writer, the sync thread and watchers.
pub(crate) struct Shared {
    pub(crate) written_lsn: AtomicU64,
    pub(crate) durable_lsn: AtomicU64,
    doorbell_pending: AtomicBool,
    pub(crate) poisoned: AtomicBool,
    state: Mutex<WaitState>,
    cond: Condvar,
    /// Latency of every segment `fdatasync`, in microseconds.
    flush_micros: Mutex<hdrhistogram::Histogram<u64>>,
    /// Indexes of sealed segments whose index file is durable, read in
    /// place ([`crate::recovery::FileIndex`]), for the writer to take up
    /// in place of their in-memory index (see `Journal::adopt_file_indexes`).
    file_indexes: Mutex<Vec<(Lsn, crate::recovery::FileIndex)>>,
    /// Whether `file_indexes` has any (one load per append tells).
    pub(crate) file_indexes_ready: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    pub(crate) fn new(durable: Lsn) -> Self {
        Shared {
            written_lsn: AtomicU64::new(durable.0),
            durable_lsn: AtomicU64::new(durable.0),
            doorbell_pending: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            state: Mutex::new(WaitState::default()),
            cond: Condvar::new(),
            flush_micros: Mutex::new(new_flush_histogram()),
            file_indexes: Mutex::new(Vec::new()),
            file_indexes_ready: AtomicBool::new(false),
        }
    }

    /// Offers the index of sealed segment `segment`, read in place from its
    /// durable index file, to the writer.
    fn offer_file_index(&self, segment: Lsn, index: crate::recovery::FileIndex) {
        lock(&self.file_indexes).push((segment, index));
        self.file_indexes_ready.store(true, Ordering::Release);
    }

    /// The indexes offered since the last call.
    pub(crate) fn take_file_indexes(&self) -> Vec<(Lsn, crate::recovery::FileIndex)> {
        self.file_indexes_ready.store(false, Ordering::Relaxed);
        std::mem::take(&mut *lock(&self.file_indexes))
    }

    /// A copy of the `fdatasync` latency histogram, in microseconds.
    pub(crate) fn flush_micros(&self) -> hdrhistogram::Histogram<u64> {
        lock(&self.flush_micros).clone()
    }

    /// Runs one segment `fdatasync` and records its latency.
    fn timed_sync(&self, seg: &dyn SegmentSync) -> std::io::Result<()> {
        let t0 = Instant::now();
        let r = seg.sync();
        let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
        lock(&self.flush_micros).saturating_record(us.max(1));
        r
    }

    pub(crate) fn poison_reason(&self) -> Option<String> {
        lock(&self.state).poisoned.clone()
    }

    fn publish(&self, durable: u64) {
        self.durable_lsn.fetch_max(durable, Ordering::SeqCst);
        let ready = {
            let mut st = lock(&self.state);
            let rest = st.callbacks.split_off(&(durable + 1));
            std::mem::replace(&mut st.callbacks, rest)
        };
        self.cond.notify_all();
        for (lsn, cbs) in ready {
            for cb in cbs {
                cb(Ok(Lsn(lsn)));
            }
        }
    }

    pub(crate) fn poison(&self, reason: String) {
        self.poisoned.store(true, Ordering::SeqCst);
        let all = {
            let mut st = lock(&self.state);
            if st.poisoned.is_none() {
                st.poisoned = Some(reason);
            }
            std::mem::take(&mut st.callbacks)
        };
        self.cond.notify_all();
        let reason = self.poison_reason().unwrap_or_default();
        for cbs in all.into_values() {
            for cb in cbs {
                cb(Err(DurabilityError::Poisoned {
                    reason: reason.clone(),
                }));
            }
        }
    }

    fn close(&self) {
        let durable = self.durable_lsn.load(Ordering::SeqCst);
        let all = {
            let mut st = lock(&self.state);
            st.closed = true;
            std::mem::take(&mut st.callbacks)
        };
        self.cond.notify_all();
        for (lsn, cbs) in all {
            for cb in cbs {
                cb(if lsn <= durable {
                    Ok(Lsn(lsn))
                } else {
                    Err(DurabilityError::Closed { lsn: Lsn(lsn) })
                });
            }
        }
    }
}

/// Messages to the sync thread.
pub(crate) enum SyncMsg {
    /// Sync now (under `Always`, or on request).
    Doorbell,
    /// The writer moved to a new segment: make the old one durable and
    /// write its index, then sync the new one from now on (and the
    /// directory, once, for its creation).
    Roll {
        sealed: Arc<dyn SegmentSync>,
        index_name: String,
        index: Arc<crate::recovery::SegmentIndex>,
        next: Arc<dyn SegmentSync>,
    },
    /// Remove these sealed segments: once every record written before the
    /// message is durable, the meta thread writes the checkpoint with their
    /// ids' state and removes their files.
    Remove(RemoveJob),
    /// Sync everything written and exit.
    Shutdown,
}

/// Snapshots saved but not durable yet: by file name those not renamed
/// into place, by table key those whose table slot is not synced. The
/// writer's process reads them from here until the meta thread made them
/// durable.
pub(crate) type PendingSnapshots = Arc<Mutex<std::collections::HashMap<String, Arc<Vec<u8>>>>>;

/// Work of the meta thread, queued without bound (nothing the appending
/// thread sends here can make it wait): index files and removals by the
/// sync thread, once what they rely on is durable; snapshots and index
/// releases by the writer itself.
pub(crate) enum MetaJob {
    /// Write the index file `name` of sealed segment `segment` from
    /// `index` (sorted and encoded here: 100-125 ms for a 16 MiB segment
    /// of 150,000 ids, which on the sync thread held up its channel and,
    /// behind it, the appending thread's snapshot saves), then offer it to
    /// the writer to be read in place.
    Index {
        segment: Lsn,
        name: String,
        index: Arc<crate::recovery::SegmentIndex>,
    },
    /// An in-memory index the writer replaced by its index file: freed
    /// here (a segment's index of a quarter of a million ids takes
    /// milliseconds to free, too long for a data core).
    Release(Arc<crate::recovery::SegmentIndex>),
    /// Remove these segments (see [`RemoveJob`]).
    Remove(RemoveJob),
    /// The writer saved a snapshot (readable from `pending` until then):
    /// write `bytes` to `tmp`, make it durable as `name`, then drop `bytes`
    /// from `pending`; with `table`, write it to the id's pair of the
    /// snapshot table instead (`name` is then only its key in `pending`).
    /// Sent by the writer straight here: through the sync thread, a save
    /// waited whenever that thread was in a sealed segment's `fdatasync`
    /// (16-55 ms for 16 MiB written under `none`) and 64 messages filled
    /// its channel.
    Snapshot {
        tmp: String,
        name: String,
        bytes: Arc<Vec<u8>>,
        pending: PendingSnapshots,
        table: Option<TableJob>,
    },
}

/// Sealed segments the writer found obsolete (every event deleted or
/// covered by a snapshot) and dropped from its catalog.
///
/// The checkpoint that must survive their removal (FORMAT.md, "Checkpoint")
/// is made by the meta thread, not the writer: the previous checkpoint
/// merged with the entries of these segments' index files. The writer kept
/// a per-id map for it (50-70 bytes per id) and sorted and encoded every
/// id's state on the appending thread at each removal: 0.4-0.8 s at a
/// million ids (`benches/snapshot_pause.rs`).
pub(crate) struct RemoveJob {
    /// The segments, by id (first LSN) and file name.
    pub(crate) segments: Vec<(Lsn, String)>,
    /// Highest segment writer epoch of the directory.
    pub(crate) max_segment_epoch: WriterEpoch,
    /// Highest LSN of any segment removed so far.
    pub(crate) removed_up_to: Lsn,
    /// The writer's last LSN when it decided: the removal waits until it is
    /// durable, so that every deletion marker that made a segment obsolete
    /// is durable before the segment goes.
    pub(crate) written: Lsn,
}

impl RemoveJob {
    /// Takes `later`'s segments into this job: one checkpoint for both.
    fn merge(&mut self, later: RemoveJob) {
        self.segments.extend(later.segments);
        self.max_segment_epoch = self.max_segment_epoch.max(later.max_segment_epoch);
        self.removed_up_to = self.removed_up_to.max(later.removed_up_to);
        self.written = self.written.max(later.written);
    }
}

/// The checkpoint after removing `job`'s segments: the previous one (if
/// any) with, per id, the maxima of its entries in their index files (last
/// event sequence number, epoch, deletion marker); and the files to remove
/// (a segment whose index file cannot be read is kept, with its index: the
/// next open finds it again).
///
/// # Errors
/// The previous checkpoint cannot be read or decoded.
fn removal_checkpoint(
    storage: &dyn Storage,
    job: &RemoveJob,
) -> Result<(Vec<u8>, Vec<String>), String> {
    use crate::format::{Checkpoint, PidCheckpoint, SegmentIndexFile, CHECKPOINT_NAME};
    let previous = match storage.read_file(CHECKPOINT_NAME) {
        Ok(b) => {
            Checkpoint::decode(&b).map_err(|e| format!("reading the checkpoint failed: {e}"))?
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Checkpoint::default(),
        Err(e) => return Err(format!("reading the checkpoint failed: {e}")),
    };
    let mut pids = previous.pids;
    let mut names = Vec::new();
    for (id, name) in &job.segments {
        let idx = crate::format::index_name(*id);
        let Ok(file) = storage
            .read_file(&idx)
            .map_err(|_| ())
            .and_then(|b| SegmentIndexFile::decode(&b).map_err(|_| ()))
        else {
            continue;
        };
        pids.extend(file.entries.into_iter().map(|(p, e)| {
            (
                p,
                PidCheckpoint {
                    last_seq: e.last_event_seq,
                    max_epoch: e.max_epoch,
                    deleted_to: e.deleted_to,
                },
            )
        }));
        names.push(name.clone());
        names.push(idx);
    }
    // One entry per id, the maxima of its entries.
    pids.sort_by(|a, b| a.0.cmp(&b.0));
    pids.dedup_by(|later, kept| {
        if later.0 != kept.0 {
            return false;
        }
        kept.1.last_seq = kept.1.last_seq.max(later.1.last_seq);
        kept.1.max_epoch = kept.1.max_epoch.max(later.1.max_epoch);
        kept.1.deleted_to = kept.1.deleted_to.max(later.1.deleted_to);
        true
    });
    let checkpoint = Checkpoint {
        max_segment_epoch: previous.max_segment_epoch.max(job.max_segment_epoch),
        removed_up_to_lsn: previous.removed_up_to_lsn.max(job.removed_up_to),
        pids,
    };
    Ok((checkpoint.encode(), names))
}

/// A snapshot save that goes to the snapshot table: the table and the id.
pub(crate) type TableJob = (Arc<SnapshotTable>, PersistenceId);

/// How long the meta thread gathers table writes before one sync covers
/// them all (ms): nothing waits for a snapshot but a segment removal
/// (which syncs the table first) and the journal's close.
const TABLE_SYNC_WINDOW: Duration = Duration::from_millis(10);

/// Table writes not synced yet, and the saves they make durable once they
/// are.
#[derive(Default)]
struct TableBatch {
    table: Option<Arc<SnapshotTable>>,
    since: Option<Instant>,
    unsettled: Vec<(String, Arc<Vec<u8>>, PendingSnapshots)>,
}

impl TableBatch {
    /// Writes save `bytes` (key `name` in `pending`) of `job`'s id.
    fn write(
        &mut self,
        job: &TableJob,
        name: String,
        bytes: Arc<Vec<u8>>,
        pending: PendingSnapshots,
    ) -> Result<(), String> {
        let (table, pid) = job;
        table.write(pid, &bytes).map_err(|e| {
            format!("writing the snapshot of {pid} to the snapshot table failed: {e}")
        })?;
        self.table = Some(table.clone());
        self.since.get_or_insert_with(Instant::now);
        self.unsettled.push((name, bytes, pending));
        Ok(())
    }

    fn dirty(&self) -> bool {
        self.since.is_some()
    }

    /// When the batch is due for its sync.
    fn deadline(&self) -> Option<Instant> {
        self.since.map(|t| t + TABLE_SYNC_WINDOW)
    }

    /// Syncs the table and settles the saves written since the last sync.
    fn sync(&mut self) -> Result<(), String> {
        if self.since.take().is_none() {
            return Ok(());
        }
        if let Some(t) = &self.table {
            t.sync()
                .map_err(|e| format!("fdatasync of the snapshot table failed: {e}"))?;
        }
        for (name, bytes, pending) in self.unsettled.drain(..) {
            settle(&pending, &name, &bytes);
        }
        Ok(())
    }
}

/// The snapshot files the meta thread put in place this run, by name (a
/// later save of one exchanges it with its spare).
#[derive(Default)]
struct SnapshotSpares {
    placed: std::collections::HashSet<String, foldhash::fast::RandomState>,
    /// Names exchanged with their spare since the directory was last
    /// synced: until it is, the spare may still be the file the name
    /// points to on disk, so it must not be rewritten before a sync.
    exchanged: std::collections::HashSet<String, foldhash::fast::RandomState>,
}

/// The spare file kept beside snapshot file `name`: a temporary name, so
/// that opening the journal removes it.
fn spare_name(name: &str) -> String {
    format!("{name}.spare{}", crate::format::TMP_SUFFIX)
}

/// Makes `bytes` snapshot file `name`, atomically and with its contents
/// durable (the directory entry once the directory is synced):
/// - the first save of `name` this run writes `tmp`, syncs it and renames
///   it over `name`;
/// - a later one writes the spare file beside it (created once, then
///   rewritten in place: same length, same blocks, so its `fdatasync`
///   writes the data block alone), syncs it and exchanges it with `name`
///   ([`Storage::exchange`]), so the old snapshot becomes the next spare:
///   no inode is created or freed per save (on ext4, creating a file per
///   snapshot cost more CPU than the rest of a durable entity's append).
///
/// Where the storage cannot exchange (or the exchange fails), the spare is
/// renamed over `name` instead, as a first save would be.
fn save_snapshot_file(
    storage: &dyn Storage,
    spares: &mut SnapshotSpares,
    tmp: &str,
    name: &str,
    bytes: &[u8],
) -> std::io::Result<()> {
    if !spares.placed.contains(name) {
        storage.write_file_synced(tmp, bytes)?;
        storage.rename(tmp, name)?;
        spares.placed.insert(name.to_string());
        return Ok(());
    }
    if spares.exchanged.contains(name) {
        // The last exchange of `name` is not durable yet: on disk the name
        // may still point at the spare's inode, which is about to be
        // rewritten. Make the exchange durable first.
        storage.sync_dir()?;
        spares.exchanged.clear();
    }
    let spare = spare_name(name);
    storage.write_file_synced(&spare, bytes)?;
    match storage.exchange(&spare, name) {
        Ok(()) => {
            spares.exchanged.insert(name.to_string());
            Ok(())
        }
        Err(_) => storage.rename(&spare, name),
    }
}

/// Whether snapshot `bytes` of file `name` still has to be written: it is
/// the newest save of `name` (`Latest`), a newer save of it is queued
/// behind (`Superseded`), or a newer one is already durable (`Durable`).
enum Standing {
    Latest,
    Superseded,
    Durable,
}

fn standing(pending: &PendingSnapshots, name: &str, bytes: &Arc<Vec<u8>>) -> Standing {
    match pending.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
        Some(b) if Arc::ptr_eq(b, bytes) => Standing::Latest,
        Some(_) => Standing::Superseded,
        None => Standing::Durable,
    }
}

/// Drops `name`'s entry of `pending` if it is still `bytes` (now durable).
fn settle(pending: &PendingSnapshots, name: &str, bytes: &Arc<Vec<u8>>) {
    let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
    if p.get(name).is_some_and(|b| Arc::ptr_eq(b, bytes)) {
        p.remove(name);
    }
}

/// Snapshot files whose queued save was skipped because a newer save of
/// the same file was queued behind it: the newer one is written when its
/// job comes, or before anything that relies on the skipped one being
/// durable (a segment removal, the end of the thread), whichever is first.
#[derive(Default)]
struct Owed {
    /// By key in `pending`; a save to the snapshot table has its job.
    names: std::collections::HashMap<String, Option<TableJob>, foldhash::fast::RandomState>,
    pending: Option<PendingSnapshots>,
}

impl Owed {
    /// Writes the newest save of every owed file that is not durable yet.
    fn pay(
        &mut self,
        storage: &dyn Storage,
        spares: &mut SnapshotSpares,
        dir_dirty: &mut bool,
        batch: &mut TableBatch,
    ) -> Result<(), String> {
        let Some(pending) = self.pending.clone() else {
            return Ok(());
        };
        for (name, table) in std::mem::take(&mut self.names) {
            let latest = pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&name)
                .cloned();
            let Some(bytes) = latest else {
                continue;
            };
            if let Some(job) = table {
                batch.write(&job, name, bytes, pending.clone())?;
                continue;
            }
            let tmp = format!("{name}.owed{}", crate::format::TMP_SUFFIX);
            save_snapshot_file(storage, spares, &tmp, &name, &bytes)
                .map_err(|e| format!("making snapshot {name} durable failed: {e}"))?;
            *dir_dirty = true;
            settle(&pending, &name, &bytes);
        }
        Ok(())
    }
}

/// The meta thread's body: runs jobs in order until the channel closes.
/// Consecutive snapshots share one directory `fsync`. A snapshot save that
/// a newer save of the same file overtook while it waited in the queue is
/// not written (the newer one is, in its place, before any segment
/// removal: see [`Owed`]); so a thread that falls behind (the first saves
/// of many entities each create a file) writes each file once, not once
/// per save. After a failure (the journal is poisoned) it drops the
/// remaining jobs: files stay as they are, which recovery handles (a
/// missing index is rebuilt by a scan, a `.tmp` is removed, segments are
/// kept).
fn run_meta(rx: Receiver<MetaJob>, shared: Arc<Shared>, storage: Arc<dyn Storage>) {
    let mut dir_dirty = false;
    let mut failed = false;
    // Snapshot files this thread put in place, and the spares it keeps
    // beside them (see `save_snapshot_file`).
    let mut spares = SnapshotSpares::default();
    let mut owed = Owed::default();
    // Snapshot table writes waiting for their sync.
    let mut batch = TableBatch::default();
    // A job taken from the queue while gathering removals, next in line.
    let mut held: Option<MetaJob> = None;
    loop {
        let job = if let Some(j) = held.take() {
            Some(j)
        } else if dir_dirty || batch.dirty() {
            // Table writes wait out their window for more saves to share
            // the sync; a directory sync alone waits for nothing.
            let wait = batch.deadline().map_or(Duration::ZERO, |d| {
                d.saturating_duration_since(Instant::now())
            });
            rx.recv_timeout(wait).ok()
        } else {
            match rx.recv() {
                Ok(j) => Some(j),
                Err(_) => {
                    if !failed && !owed.names.is_empty() {
                        // The writer closed: what was skipped is written
                        // now (then the directory synced, next round).
                        if let Err(reason) =
                            owed.pay(&*storage, &mut spares, &mut dir_dirty, &mut batch)
                        {
                            shared.poison(reason);
                            failed = true;
                        }
                        continue;
                    }
                    return;
                }
            }
        };
        if let Some(MetaJob::Release(index)) = job {
            drop(index);
            continue;
        }
        // Removals queued one after another share one checkpoint (each
        // costs a durable write of it: with small segments under load,
        // one per segment kept this thread from catching up).
        let mut job = job;
        if let Some(MetaJob::Remove(first)) = &mut job {
            loop {
                match rx.try_recv() {
                    Ok(MetaJob::Remove(next)) => first.merge(next),
                    Ok(MetaJob::Release(index)) => drop(index),
                    Ok(other) => {
                        held = Some(other);
                        break;
                    }
                    Err(_) => break,
                }
            }
        }
        if failed || shared.poisoned.load(Ordering::SeqCst) {
            failed = true;
            if job.is_none() {
                dir_dirty = false;
                batch = TableBatch::default();
            }
            continue;
        }
        let is_snapshot = matches!(job, Some(MetaJob::Snapshot { .. }));
        // A removal relies on every snapshot saved before it being
        // durable: a skipped one is written first.
        if matches!(job, Some(MetaJob::Remove { .. })) {
            if let Err(reason) = owed.pay(&*storage, &mut spares, &mut dir_dirty, &mut batch) {
                shared.poison(reason);
                failed = true;
                continue;
            }
        }
        // Table writes are synced before anything else too (a removal
        // relies on them; an index or the end of the queue is a natural
        // point to settle them), and when their window is over even while
        // more snapshots keep coming.
        let due = batch.deadline().is_some_and(|d| Instant::now() >= d);
        if batch.dirty() && (!is_snapshot || due) {
            if let Err(reason) = batch.sync() {
                shared.poison(reason);
                failed = true;
                continue;
            }
        }
        // A directory sync owed by earlier snapshots comes before anything
        // else (a removal must not overtake a snapshot).
        if dir_dirty && !is_snapshot {
            if let Err(e) = storage.sync_dir() {
                shared.poison(format!("fsync of the journal directory failed: {e}"));
                failed = true;
                continue;
            }
            dir_dirty = false;
            spares.exchanged.clear();
        }
        let r = match job {
            None => Ok(()),
            Some(MetaJob::Index {
                segment,
                name,
                index,
            }) => {
                let bytes = index.encode_file();
                drop(index);
                storage
                    .write_file_durable(&name, &bytes)
                    .map_err(|e| format!("writing index {name} failed: {e}"))
                    .map(|()| {
                        drop(bytes);
                        // Read in place from now on; a file that cannot be
                        // mapped leaves the index in memory (nothing is lost).
                        let file = storage.map_file(&name).ok();
                        if let Some(Ok(Some(index))) = file.map(crate::recovery::FileIndex::new) {
                            shared.offer_file_index(segment, index);
                        }
                    })
            }
            // Freed as soon as taken from the queue, above.
            Some(MetaJob::Release(_)) => Ok(()),
            Some(MetaJob::Remove(job)) => removal_checkpoint(&*storage, &job)
                .and_then(|(checkpoint, names)| {
                    storage
                        .write_file_durable(crate::format::CHECKPOINT_NAME, &checkpoint)
                        .map_err(|e| format!("writing the checkpoint failed: {e}"))
                        .map(|()| names)
                })
                .map(|names| {
                    for n in &names {
                        // A file that cannot be removed is only wasted
                        // space: the checkpoint already covers it, and
                        // the next open removes it again.
                        let _ = storage.remove(n);
                    }
                    let _ = storage.sync_dir();
                }),
            Some(MetaJob::Snapshot {
                tmp,
                name,
                bytes,
                pending,
                table,
            }) => match (standing(&pending, &name, &bytes), table) {
                (Standing::Durable, _) => Ok(()),
                (Standing::Superseded, table) => {
                    owed.names.insert(name, table);
                    owed.pending = Some(pending);
                    Ok(())
                }
                (Standing::Latest, Some(job)) => {
                    owed.names.remove(&name);
                    batch.write(&job, name, bytes, pending)
                }
                (Standing::Latest, None) => {
                    save_snapshot_file(&*storage, &mut spares, &tmp, &name, &bytes)
                        .map_err(|e| format!("making snapshot {name} durable failed: {e}"))
                        .map(|()| {
                            dir_dirty = true;
                            settle(&pending, &name, &bytes);
                            owed.names.remove(&name);
                        })
                }
            },
        };
        if let Err(reason) = r {
            shared.poison(reason);
            failed = true;
        }
    }
}

/// Handle a runtime uses to learn when LSNs are durable, without blocking
/// when it does not want to. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct DurabilityWatcher {
    shared: Arc<Shared>,
    tx: Sender<SyncMsg>,
    ring_on_wait: bool,
}

impl std::fmt::Debug for DurabilityWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurabilityWatcher")
            .field("durable_lsn", &self.durable_lsn())
            .finish()
    }
}

impl DurabilityWatcher {
    pub(crate) fn new(shared: Arc<Shared>, tx: Sender<SyncMsg>, policy: Durability) -> Self {
        Self {
            shared,
            tx,
            ring_on_wait: matches!(policy, Durability::None),
        }
    }

    /// The highest LSN known durable (every LSN at or below it is durable).
    /// Never blocks.
    pub fn durable_lsn(&self) -> Lsn {
        Lsn(self.shared.durable_lsn.load(Ordering::SeqCst))
    }

    /// Whether `lsn` is durable. Never blocks.
    pub fn is_durable(&self, lsn: Lsn) -> bool {
        self.shared.durable_lsn.load(Ordering::SeqCst) >= lsn.0
    }

    /// The poisoning reason, if the journal is poisoned. Never blocks.
    pub fn poisoned(&self) -> Option<String> {
        if self.shared.poisoned.load(Ordering::SeqCst) {
            self.shared.poison_reason()
        } else {
            None
        }
    }

    fn ring(&self) {
        if self.ring_on_wait {
            ring(&self.shared, &self.tx);
        }
    }

    /// Blocks until `lsn` is durable. Under `Durability::None` it first
    /// asks the sync thread to flush.
    ///
    /// # Errors
    /// [`DurabilityError::Poisoned`] when a flush failed before `lsn` was
    /// durable; [`DurabilityError::Closed`] when the journal closed first.
    pub fn wait_durable(&self, lsn: Lsn) -> Result<(), DurabilityError> {
        self.wait_durable_timeout(lsn, Duration::MAX).map(|_| ())
    }

    /// Blocks until `lsn` is durable or `timeout` passes; `Ok(false)` on
    /// timeout.
    ///
    /// # Errors
    /// As [`DurabilityWatcher::wait_durable`].
    pub fn wait_durable_timeout(
        &self,
        lsn: Lsn,
        timeout: Duration,
    ) -> Result<bool, DurabilityError> {
        if self.is_durable(lsn) {
            return Ok(true);
        }
        self.ring();
        let deadline = Instant::now().checked_add(timeout);
        let mut st = lock(&self.shared.state);
        loop {
            if self.is_durable(lsn) {
                return Ok(true);
            }
            if let Some(reason) = &st.poisoned {
                return Err(DurabilityError::Poisoned {
                    reason: reason.clone(),
                });
            }
            if st.closed {
                return Err(DurabilityError::Closed { lsn });
            }
            match deadline {
                None => st = self.shared.cond.wait(st).unwrap_or_else(|e| e.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(false);
                    }
                    st = self
                        .shared
                        .cond
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
        }
    }

    /// Runs `callback` once `lsn` is durable (with `Ok(lsn)`) or will never
    /// be (with the error). It runs on the calling thread when the outcome is
    /// already known, else on the journal's sync thread, so it must be short
    /// and must not block: wake a task (`Waker::wake`), send on a channel,
    /// set a flag. This is how an executor awaits durability without a
    /// blocked thread and without depending on any async runtime.
    pub fn on_durable(
        &self,
        lsn: Lsn,
        callback: impl FnOnce(Result<Lsn, DurabilityError>) + Send + 'static,
    ) {
        if self.is_durable(lsn) {
            callback(Ok(lsn));
            return;
        }
        let mut st = lock(&self.shared.state);
        // Re-check under the lock: `publish` takes the lock after raising
        // `durable_lsn`, so either we see the new value or it sees our entry.
        if self.is_durable(lsn) {
            drop(st);
            callback(Ok(lsn));
            return;
        }
        if let Some(reason) = st.poisoned.clone() {
            drop(st);
            callback(Err(DurabilityError::Poisoned { reason }));
            return;
        }
        if st.closed {
            drop(st);
            callback(Err(DurabilityError::Closed { lsn }));
            return;
        }
        st.callbacks
            .entry(lsn.0)
            .or_default()
            .push(Box::new(callback));
        drop(st);
        self.ring();
    }
}

/// Rings the doorbell unless one is already pending.
pub(crate) fn ring(shared: &Shared, tx: &Sender<SyncMsg>) {
    if !shared.doorbell_pending.swap(true, Ordering::SeqCst) {
        let _ = tx.try_send(SyncMsg::Doorbell);
    }
}

/// The sync thread's body: starts the meta thread on `meta` (the
/// channel's receiving end; the writer keeps a sender of its own and must
/// drop it before it asks this thread to shut down, or the meta thread
/// would not end) with `meta_tx`, this thread's sender to it. Returns when
/// told to shut down, when the channel closes, or after poisoning the
/// journal, once the meta thread ended.
pub(crate) fn run(
    rx: Receiver<SyncMsg>,
    shared: Arc<Shared>,
    storage: Arc<dyn Storage>,
    policy: Durability,
    mut current: Arc<dyn SegmentSync>,
    (meta_tx, meta_rx): (Sender<MetaJob>, Receiver<MetaJob>),
) {
    let interval = match policy {
        Durability::Interval(d) => Some(d.max(Duration::from_micros(1))),
        _ => None,
    };
    let mut next_tick = interval.map(|d| Instant::now() + d);
    let mut dir_dirty = true;
    let meta = {
        let shared = shared.clone();
        let storage = storage.clone();
        std::thread::Builder::new()
            .name("journal-meta".into())
            .spawn(move || run_meta(meta_rx, shared, storage))
    };
    let meta = match meta {
        Ok(h) => h,
        Err(e) => {
            shared.poison(format!("starting the journal's meta thread failed: {e}"));
            shared.close();
            return;
        }
    };

    // Set when a doorbell may have been consumed by the drain below after
    // its LSN was already past `target`: go round again without blocking.
    let mut again = false;
    // Removals waiting for the records written before them to be durable.
    let mut removals: Vec<RemoveJob> = Vec::new();
    // Shutdown was asked: stop once no removal waits (one more round
    // makes the records written before the last of them durable).
    let mut closing = false;
    loop {
        let first = if std::mem::take(&mut again) {
            Some(SyncMsg::Doorbell)
        } else {
            match next_tick {
                Some(t) => match rx.recv_timeout(t.saturating_duration_since(Instant::now())) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => Some(SyncMsg::Shutdown),
                },
                None => Some(rx.recv().unwrap_or(SyncMsg::Shutdown)),
            }
        };
        // A doorbell whose message did not fit in the channel (full of
        // rolls) is still owed: the flag says so.
        let rung = shared.doorbell_pending.swap(false, Ordering::SeqCst);
        let target = shared.written_lsn.load(Ordering::Acquire);
        let mut want_sync = rung || closing || !removals.is_empty();
        let mut shutdown = false;
        let mut pending = first;
        loop {
            let Some(msg) = pending.take().or_else(|| rx.try_recv().ok()) else {
                break;
            };
            let result = match msg {
                SyncMsg::Doorbell => {
                    want_sync = true;
                    Ok(())
                }
                SyncMsg::Shutdown => {
                    want_sync = true;
                    shutdown = true;
                    Ok(())
                }
                SyncMsg::Roll {
                    sealed,
                    index_name,
                    index,
                    next,
                } => {
                    // The index describes the sealed segment's records: it
                    // is written (on the meta thread) only after they are
                    // durable. Until then recovery scans the segment.
                    let r = shared
                        .timed_sync(&*sealed)
                        .map_err(|e| format!("fdatasync of a sealed segment failed: {e}"))
                        .map(|()| {
                            let _ = meta_tx.send(MetaJob::Index {
                                segment: index.id,
                                name: index_name,
                                index,
                            });
                        });
                    current = next;
                    dir_dirty = true;
                    r
                }
                SyncMsg::Remove(job) => {
                    // Sent on once everything written before it is
                    // durable (below).
                    want_sync = true;
                    removals.push(job);
                    Ok(())
                }
            };
            if let Err(reason) = result {
                shared.poison(reason);
                break;
            }
        }
        if let (Some(d), Some(t)) = (interval, next_tick) {
            let now = Instant::now();
            if now >= t {
                want_sync = true;
                let mut n = t + d;
                if n <= now {
                    n = now + d;
                }
                next_tick = Some(n);
            }
        }
        if shared.poisoned.load(Ordering::SeqCst) {
            // Nothing more becomes durable.
            break;
        }
        if want_sync && target > shared.durable_lsn.load(Ordering::SeqCst) {
            let r = shared
                .timed_sync(&*current)
                .map_err(|e| format!("fdatasync of the current segment failed: {e}"))
                .and_then(|()| {
                    if dir_dirty {
                        storage
                            .sync_dir()
                            .map_err(|e| format!("fsync of the journal directory failed: {e}"))
                    } else {
                        Ok(())
                    }
                });
            match r {
                Ok(()) => {
                    dir_dirty = false;
                    shared.publish(target);
                }
                Err(reason) => {
                    shared.poison(reason);
                    break;
                }
            }
        }
        let durable = Lsn(shared.durable_lsn.load(Ordering::SeqCst));
        let (ready, waiting): (Vec<_>, Vec<_>) =
            removals.drain(..).partition(|j| j.written <= durable);
        // One job for all that are ready: one checkpoint.
        let mut ready = ready.into_iter();
        if let Some(mut job) = ready.next() {
            for later in ready {
                job.merge(later);
            }
            let _ = meta_tx.send(MetaJob::Remove(job));
        }
        removals = waiting;
        closing |= shutdown;
        if closing && removals.is_empty() {
            break;
        }
        again = shared.doorbell_pending.load(Ordering::SeqCst) || !removals.is_empty();
    }
    // Nothing more is taken from the channel: the writer's sends fail from
    // here on instead of filling it while this thread waits for the meta
    // thread (which, after a poisoning, ends only once the writer dropped
    // its own sender: a writer that kept sending to a full channel would
    // wait forever).
    drop(rx);
    // The meta thread finishes its queued work (it sees the channel close),
    // so that a closed journal leaves every file in place. If it panicked,
    // work queued behind the job it failed in was dropped: a snapshot saved
    // before a close may not be durable, so the close must not say it is.
    drop(meta_tx);
    if meta.join().is_err() {
        shared.poison("the journal's meta thread panicked".to_string());
    }
    shared.close();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::{MemoryStorage, MmapStorage};

    fn save(storage: &dyn Storage, spares: &mut SnapshotSpares, n: u32) {
        let bytes = format!("snapshot {n}").into_bytes();
        save_snapshot_file(
            storage,
            spares,
            &format!("a.snap.{n}.tmp"),
            "a.snap",
            &bytes,
        )
        .expect("save");
    }

    #[test]
    fn later_saves_exchange_the_snapshot_with_its_spare() {
        let s = MemoryStorage::new();
        let mut spares = SnapshotSpares::default();
        for n in 1..=4 {
            save(&s, &mut spares, n);
            assert_eq!(
                s.read_file("a.snap").expect("snapshot"),
                format!("snapshot {n}").into_bytes()
            );
        }
        assert_eq!(
            s.read_file(&spare_name("a.snap")).expect("spare"),
            b"snapshot 3".to_vec(),
            "the spare holds the snapshot before the last"
        );
        let mut names = s.list().expect("list");
        names.sort();
        assert_eq!(
            names,
            vec!["a.snap".to_string(), spare_name("a.snap")],
            "no temporary file left"
        );
    }

    #[test]
    fn a_spare_is_not_rewritten_before_its_last_exchange_is_durable() {
        let s = crate::storage::FaultyStorage::new(MemoryStorage::new());
        let mut spares = SnapshotSpares::default();
        save(&s, &mut spares, 1);
        save(&s, &mut spares, 2);
        // The exchange of save 2 is not synced yet: save 3 must sync the
        // directory before it rewrites the spare (the inode that held
        // snapshot 1). With the sync failing, the spare stays untouched.
        s.faults().fail_sync.store(true, Ordering::SeqCst);
        let r = save_snapshot_file(&s, &mut spares, "a.snap.3.tmp", "a.snap", b"snapshot 3");
        assert!(r.is_err(), "the directory sync failed");
        assert_eq!(
            s.read_file(&spare_name("a.snap")).expect("spare"),
            b"snapshot 1".to_vec(),
            "the spare was not rewritten"
        );
        assert_eq!(s.read_file("a.snap").expect("snap"), b"snapshot 2".to_vec());
        // Once synced, later saves go on.
        s.faults().fail_sync.store(false, Ordering::SeqCst);
        save(&s, &mut spares, 3);
        assert_eq!(s.read_file("a.snap").expect("snap"), b"snapshot 3".to_vec());
    }

    #[test]
    fn on_a_file_system_the_same_two_inodes_serve_every_later_save() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tmp");
        let s = MmapStorage::new(dir.path()).expect("storage");
        let mut spares = SnapshotSpares::default();
        let inodes = |d: &std::path::Path| {
            let mut v = vec![
                std::fs::metadata(d.join("a.snap")).expect("snap").ino(),
                std::fs::metadata(d.join(spare_name("a.snap")))
                    .expect("spare")
                    .ino(),
            ];
            v.sort_unstable();
            v
        };
        save(&s, &mut spares, 1);
        save(&s, &mut spares, 2);
        let two = inodes(dir.path());
        for n in 3..=6 {
            save(&s, &mut spares, n);
            assert_eq!(
                inodes(dir.path()),
                two,
                "save {n} created or freed no inode"
            );
            assert_eq!(
                s.read_file("a.snap").expect("snapshot"),
                format!("snapshot {n}").into_bytes()
            );
        }
    }

    #[test]
    fn without_exchange_a_later_save_renames_its_spare_into_place() {
        // The default `exchange` is unsupported: a storage without it.
        #[derive(Debug)]
        struct NoExchange(MemoryStorage);
        impl Storage for NoExchange {
            fn list(&self) -> std::io::Result<Vec<String>> {
                self.0.list()
            }
            fn create_segment(
                &self,
                name: &str,
                size_bytes: u64,
            ) -> std::io::Result<Box<dyn crate::storage::SegmentFile>> {
                self.0.create_segment(name, size_bytes)
            }
            fn open_segment(
                &self,
                name: &str,
                writable: bool,
            ) -> std::io::Result<Box<dyn crate::storage::SegmentFile>> {
                self.0.open_segment(name, writable)
            }
            fn truncate(&self, name: &str, len_bytes: u64) -> std::io::Result<()> {
                self.0.truncate(name, len_bytes)
            }
            fn read_file(&self, name: &str) -> std::io::Result<Vec<u8>> {
                self.0.read_file(name)
            }
            fn write_file_durable(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
                self.0.write_file_durable(name, bytes)
            }
            fn write_file(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
                self.0.write_file(name, bytes)
            }
            fn sync_file(&self, name: &str) -> std::io::Result<()> {
                self.0.sync_file(name)
            }
            fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
                self.0.rename(from, to)
            }
            fn remove(&self, name: &str) -> std::io::Result<()> {
                self.0.remove(name)
            }
            fn sync_dir(&self) -> std::io::Result<()> {
                self.0.sync_dir()
            }
        }
        let s = NoExchange(MemoryStorage::new());
        let mut spares = SnapshotSpares::default();
        for n in 1..=3 {
            save(&s, &mut spares, n);
            assert_eq!(
                s.read_file("a.snap").expect("snapshot"),
                format!("snapshot {n}").into_bytes()
            );
        }
        assert_eq!(s.list().expect("list"), vec!["a.snap".to_string()]);
    }
}
