//! Recovery: turning a directory into segment indexes and per persistence
//! id state, following the decision table in FORMAT.md ("Recovery").

use std::collections::BTreeSet;

pub(crate) use crate::pidmap::{pid_hash, PidMap};
use std::sync::OnceLock;

use crate::error::{CorruptionKind, RecoveryError};
use crate::format::{
    self, decode_record, index_name, parse_numbered_name, scan_records, Checkpoint, Decoded,
    HeaderError, IndexEntry, PidCheckpoint, RecordKind, RecordView, ScanStop, SegmentHeader,
    SegmentIndexFile, CHECKPOINT_NAME, INDEX_SUFFIX, SEGMENT_SUFFIX, TMP_SUFFIX,
};
use crate::ids::{Lsn, PersistenceId, SequenceNr, WriterEpoch};
use crate::storage::{SegmentFile, Storage};
use crate::RecoveryMode;

/// The in-memory index of one segment: per persistence id, its events'
/// sequence numbers and offsets, and summary fields.
#[derive(Debug, Clone)]
pub struct SegmentIndex {
    pub(crate) id: Lsn,
    pub(crate) epoch: WriterEpoch,
    pub(crate) end_offset: u64,
    pub(crate) last_lsn: Lsn,
    pub(crate) records: u64,
    pub(crate) pids: PidMap<PidEntry>,
    /// Per id with a deletion marker in the segment, the highest (kept
    /// apart: few ids delete, and every entry of `pids` would otherwise
    /// carry 8 bytes for it).
    pub(crate) deleted: PidMap<SequenceNr>,
}

impl SegmentIndex {
    pub(crate) fn new(id: Lsn, epoch: WriterEpoch) -> Self {
        SegmentIndex {
            id,
            epoch,
            end_offset: format::SEGMENT_HEADER_LEN_BYTES as u64,
            last_lsn: Lsn(id.0.saturating_sub(1)),
            records: 0,
            pids: PidMap::default(),
            deleted: PidMap::default(),
        }
    }

    /// The summary fields alone, without the per-id entries.
    pub(crate) fn summary(&self) -> SegmentIndex {
        SegmentIndex {
            id: self.id,
            epoch: self.epoch,
            end_offset: self.end_offset,
            last_lsn: self.last_lsn,
            records: self.records,
            pids: PidMap::default(),
            deleted: PidMap::default(),
        }
    }

    /// The highest deletion marker of `pid` in the segment (0 when none).
    pub(crate) fn deleted_to(&self, pid: &str) -> SequenceNr {
        self.deleted.get(pid).copied().unwrap_or_default()
    }

    /// Adds a record that was just written by `pid`'s writer (the index
    /// shares its id; `hash` is [`pid_hash`] of it). (The fields are passed one by one: the appender has
    /// no decoded view.)
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add(
        &mut self,
        pid: &PersistenceId,
        hash: u64,
        kind: RecordKind,
        seq: SequenceNr,
        epoch: WriterEpoch,
        lsn: Lsn,
        offset: u64,
        len_bytes: u64,
    ) {
        let e = self.pids.get_or_insert_with(hash, pid, PidEntry::default);
        e.max_epoch = e.max_epoch.max(epoch);
        match kind {
            RecordKind::Event => e.events.push(seq, offset as u32),
            RecordKind::Deletion => {
                let d = self
                    .deleted
                    .get_or_insert_with(hash, pid, SequenceNr::default);
                *d = (*d).max(seq);
            }
        }
        self.records += 1;
        self.last_lsn = lsn;
        self.end_offset = offset + len_bytes;
    }

    /// Adds a record validated by a scan (its id read from the segment).
    #[allow(clippy::too_many_arguments)]
    fn add_scanned(
        &mut self,
        pid: &str,
        kind: RecordKind,
        seq: SequenceNr,
        epoch: WriterEpoch,
        lsn: Lsn,
        offset: u64,
        len_bytes: u64,
    ) {
        let p = match self.pids.get_key_value(pid) {
            Some((p, _)) => p.clone(),
            None => match PersistenceId::new(pid) {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        self.add(&p, pid_hash(pid), kind, seq, epoch, lsn, offset, len_bytes);
    }

    fn add_view(&mut self, r: &RecordView<'_>) {
        let pid = std::str::from_utf8(r.persistence_id).unwrap_or("");
        self.add_scanned(
            pid,
            r.kind,
            r.sequence_nr,
            r.writer_epoch,
            r.lsn,
            r.offset,
            r.len_bytes,
        );
    }

    /// The decoded form of the index file (what [`Self::encode_file`]'s
    /// bytes decode to; kept for the test that says so).
    #[cfg(test)]
    pub(crate) fn to_file(&self) -> SegmentIndexFile {
        let mut entries: Vec<_> = self
            .pids
            .iter()
            .map(|(p, e)| (p.clone(), e.to_index_entry(self.deleted_to(p.as_str()))))
            .collect();
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        SegmentIndexFile {
            segment_id: self.id,
            writer_epoch: self.epoch,
            end_offset: self.end_offset,
            last_lsn: self.last_lsn,
            records: self.records,
            entries,
        }
    }

    /// The index file's bytes, the same as `self.to_file().encode()`
    /// gives, written straight from the in-memory entries: the ids are
    /// sorted as references and nothing is allocated per id (`to_file`
    /// clones every id and allocates each entry's event list: 100-125 ms
    /// for a 16 MiB segment's 150,000 ids, `benches/snapshot_pause.rs`).
    pub(crate) fn encode_file(&self) -> Vec<u8> {
        let mut entries: Vec<(&str, &PidEntry)> =
            self.pids.iter().map(|(p, e)| (p.as_str(), e)).collect();
        // Ids are unique: an unstable sort orders them the same way.
        entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        let size = format::IndexFileWriter::FRAME_BYTES
            + entries
                .iter()
                .map(|(p, e)| {
                    format::INDEX_ENTRY_FIXED_BYTES
                        + p.len()
                        + e.events.len() as usize * format::INDEX_EVENT_BYTES
                })
                .sum::<usize>();
        let mut w = format::IndexFileWriter::new(
            (
                self.id,
                self.epoch,
                self.end_offset,
                self.last_lsn,
                self.records,
            ),
            entries.len() as u32,
            size,
        );
        for (p, e) in entries {
            w.entry(
                p,
                (e.max_epoch, e.last_event_seq(), self.deleted_to(p)),
                e.events.len(),
                e.events.iter(),
            );
        }
        let bytes = w.finish();
        debug_assert_eq!(bytes.len(), size, "an index file's size, computed");
        bytes
    }

    fn from_file(f: SegmentIndexFile) -> Self {
        let mut index = SegmentIndex {
            id: f.segment_id,
            epoch: f.writer_epoch,
            end_offset: f.end_offset,
            last_lsn: f.last_lsn,
            records: f.records,
            pids: PidMap::default(),
            deleted: PidMap::default(),
        };
        for (p, e) in f.entries {
            if e.deleted_to > SequenceNr(0) {
                index.deleted.insert(p.clone(), e.deleted_to);
            }
            index.pids.insert(p, PidEntry::from_index_entry(e));
        }
        index
    }
}

/// One persistence id's records in one segment, in memory (the index
/// file's [`IndexEntry`], compacted; its deletion marker is in
/// [`SegmentIndex::deleted`]): 24 bytes, and no heap block for an id with
/// a single event in the segment (the common case: a million entities
/// written once each), where a `Vec` and its one-element block took 40
/// more.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PidEntry {
    /// Highest writer epoch among this id's records in the segment.
    pub(crate) max_epoch: WriterEpoch,
    /// The id's events in the segment, in order.
    pub(crate) events: Events,
}

const _: () = assert!(std::mem::size_of::<PidEntry>() == 24);
const _: () = assert!(std::mem::size_of::<Events>() == 16);

impl PidEntry {
    /// Highest event sequence number in the segment (0 when none): the
    /// last event's, as sequence numbers increase per id.
    pub(crate) fn last_event_seq(&self) -> SequenceNr {
        self.events.last().map_or(SequenceNr(0), |(s, _)| s)
    }

    #[cfg(test)]
    fn to_index_entry(&self, deleted_to: SequenceNr) -> IndexEntry {
        IndexEntry {
            max_epoch: self.max_epoch,
            last_event_seq: self.last_event_seq(),
            deleted_to,
            events: self.events.iter().collect(),
        }
    }

    fn from_index_entry(e: IndexEntry) -> Self {
        let mut events = Events::default();
        for (seq, off) in e.events {
            events.push(seq, off);
        }
        PidEntry {
            max_epoch: e.max_epoch,
            events,
        }
    }
}

/// The (sequence number, offset in bytes) of one id's events in a
/// segment, in order, in 16 bytes:
/// - none or one, inline: an id written once in the segment, the most
///   common case, has no heap block. An event numbered 0 counts as none;
///   this journal's writer never appends one, only a scan or an index
///   file could bring it from elsewhere, and replay starts at sequence
///   number 1, so it was never read anyway;
/// - from the second event, a list whose length and capacity are in the
///   entry itself, so that appending to a hot id's list writes its next
///   element without first loading a header from the heap (a `ThinVec`
///   did: one cache miss per append).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Events {
    /// None or one.
    One(OneEvent),
    /// Two or more.
    Many(EventList),
}

/// No event (sequence number 0: events are numbered from 1; only deletion
/// markers) or one, in 12 bytes aligned to 4, so that it fits beside an
/// [`EventList`]'s fields before the capacity's niche.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct OneEvent {
    /// The sequence number's low and high halves.
    seq: [u32; 2],
    offset: u32,
}

impl OneEvent {
    const NONE: OneEvent = OneEvent {
        seq: [0, 0],
        offset: 0,
    };

    fn new(seq: SequenceNr, offset: u32) -> Self {
        OneEvent {
            seq: [seq.0 as u32, (seq.0 >> 32) as u32],
            offset,
        }
    }

    fn get(self) -> Option<(SequenceNr, u32)> {
        let seq = u64::from(self.seq[0]) | (u64::from(self.seq[1]) << 32);
        (seq > 0).then_some((SequenceNr(seq), self.offset))
    }
}

impl Default for Events {
    fn default() -> Self {
        Events::One(OneEvent::NONE)
    }
}

impl Events {
    fn push(&mut self, seq: SequenceNr, offset: u32) {
        match self {
            Events::One(one) => match one.get() {
                None => *one = OneEvent::new(seq, offset),
                Some(first) => {
                    *self = Events::Many(EventList::from(vec![first, (seq, offset)]));
                }
            },
            Events::Many(v) => v.push((seq, offset)),
        }
    }

    /// How many there are (count).
    pub(crate) fn len(&self) -> u32 {
        match self {
            Events::One(one) => u32::from(one.get().is_some()),
            Events::Many(v) => v.len,
        }
    }

    /// Whether there are none.
    pub(crate) fn is_empty(&self) -> bool {
        matches!(self, Events::One(one) if one.get().is_none())
    }

    /// The last event.
    pub(crate) fn last(&self) -> Option<(SequenceNr, u32)> {
        match self {
            Events::One(one) => one.get(),
            Events::Many(v) => v.as_slice().last().copied(),
        }
    }

    /// The events with a sequence number at least `from`, in order.
    pub(crate) fn since(&self, from: SequenceNr) -> impl Iterator<Item = (SequenceNr, u32)> + '_ {
        type Event = (SequenceNr, u32);
        let (one, many): (Option<Event>, &[Event]) = match self {
            Events::One(one) => (one.get().filter(|(s, _)| *s >= from), &[]),
            Events::Many(v) => {
                let v = v.as_slice();
                let start = v.partition_point(|(s, _)| *s < from);
                (None, &v[start..])
            }
        };
        one.into_iter().chain(many.iter().copied())
    }

    /// Every event, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (SequenceNr, u32)> + '_ {
        self.since(SequenceNr(0))
    }
}

/// A list of two or more events of [`Events::Many`]: a `Vec`'s pointer,
/// length and capacity, the last two as `u32` (a segment's offsets are
/// `u32`, so it holds fewer than 2^32 records) and the capacity non-zero,
/// which leaves [`Events::One`] room beside it: 16 bytes (in this field
/// order, with the capacity's zero, at the end, the one value that tells
/// the variants apart; a `NonNull` pointer would offer it at the start,
/// where `One` does not fit beside it).
#[repr(C)]
pub(crate) struct EventList {
    ptr: *mut (SequenceNr, u32),
    len: u32,
    cap: std::num::NonZeroU32,
}

// SAFETY: an `EventList` owns its block as a `Vec` does (no shared state).
unsafe impl Send for EventList {}
// SAFETY: as above; `&EventList` only reads.
unsafe impl Sync for EventList {}

impl From<Vec<(SequenceNr, u32)>> for EventList {
    /// Takes `v`'s block. Panics when `v` has no block or holds 2^32
    /// events or more (a segment holds fewer records).
    fn from(v: Vec<(SequenceNr, u32)>) -> Self {
        let mut v = std::mem::ManuallyDrop::new(v);
        EventList::parts(&mut v).expect("a list with a block of fewer than 2^32 events")
    }
}

impl EventList {
    /// The fields naming `v`'s block; `None` when it has none or its
    /// length or capacity does not fit a `u32`. The caller must not drop
    /// `v` as well.
    fn parts(v: &mut Vec<(SequenceNr, u32)>) -> Option<EventList> {
        Some(EventList {
            len: u32::try_from(v.len()).ok()?,
            cap: std::num::NonZeroU32::new(u32::try_from(v.capacity()).ok()?)?,
            ptr: v.as_mut_ptr(),
        })
    }

    /// The list as the `Vec` it was made from, owning the block; the
    /// caller must not drop both.
    fn as_vec(&self) -> std::mem::ManuallyDrop<Vec<(SequenceNr, u32)>> {
        // SAFETY: `ptr`, `len` and `cap` are those of a `Vec` of this
        // element type (taken in `from`, or written back by `push`), and
        // the `ManuallyDrop` keeps the block from being freed twice.
        std::mem::ManuallyDrop::new(unsafe {
            Vec::from_raw_parts(self.ptr, self.len as usize, self.cap.get() as usize)
        })
    }

    fn push(&mut self, event: (SequenceNr, u32)) {
        // Kept undroppable: should `push` unwind, `self` still owns the
        // block (a `Vec` panics on growth before it moves its block).
        let mut v = self.as_vec();
        v.push(event);
        // Written back at once: `push` may have moved the block. A length
        // or capacity of 2^32 cannot happen (a segment holds fewer
        // records); were it to, unwinding here would leave `self` naming a
        // freed block, so the process aborts, as on a failed allocation.
        let Some(parts) = EventList::parts(&mut v) else {
            std::process::abort();
        };
        // The old fields are overwritten, not dropped: their block is
        // `v`'s now, or freed by its growth.
        std::mem::forget(std::mem::replace(self, parts));
    }

    fn as_slice(&self) -> &[(SequenceNr, u32)] {
        // SAFETY: the first `len` elements of the block are initialised
        // and live as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len as usize) }
    }
}

impl Drop for EventList {
    fn drop(&mut self) {
        drop(std::mem::ManuallyDrop::into_inner(self.as_vec()));
    }
}

impl Clone for EventList {
    fn clone(&self) -> Self {
        EventList::from(self.as_slice().to_vec())
    }
}

impl PartialEq for EventList {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for EventList {}

impl std::fmt::Debug for EventList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// Whether every entry of an index file lists its events in strictly
/// increasing sequence order and names the last of them as its highest
/// (0 when none), as the writer wrote it. Memory keeps only the events
/// (the highest is the last), so a file that passed its checksum but
/// says otherwise is treated as damaged: its segment is scanned.
fn events_in_order(f: &SegmentIndexFile) -> bool {
    f.entries.iter().all(|(_, e)| {
        e.events.windows(2).all(|w| w[0].0 < w[1].0)
            && e.last_event_seq == e.events.last().map_or(SequenceNr(0), |(s, _)| *s)
    })
}

/// A segment that is no longer appended to (by this process).
///
/// Its index is in memory ([`SealedSegment::index`]) until its index file
/// is durable; from then on the file is read in place
/// ([`SealedSegment::file_index`]) and `index` keeps only the summary
/// fields. An id costs a sealed segment 8 bytes of heap instead of the
/// 50-70 of a [`PidMap`] entry, so the heap no longer grows with the
/// number of segments an id has events in.
pub(crate) struct SealedSegment {
    pub(crate) name: String,
    pub(crate) index: std::sync::Arc<SegmentIndex>,
    pub(crate) file_index: Option<FileIndex>,
    pub(crate) has_index_file: bool,
    pub(crate) file: OnceLock<Box<dyn SegmentFile>>,
}

/// One persistence id's records in one sealed segment, from either form
/// of its index.
#[derive(Clone, Copy)]
pub(crate) enum EntryRef<'a> {
    /// From the in-memory index, with the id's deletion marker.
    Memory(&'a PidEntry, SequenceNr),
    /// Read in place from the index file.
    File(format::IndexEntryView<'a>),
}

impl EntryRef<'_> {
    /// Highest writer epoch among the id's records in the segment.
    pub(crate) fn max_epoch(&self) -> WriterEpoch {
        match self {
            EntryRef::Memory(e, _) => e.max_epoch,
            EntryRef::File(v) => v.max_epoch,
        }
    }

    /// Highest event sequence number in the segment (0 when none).
    pub(crate) fn last_event_seq(&self) -> SequenceNr {
        match self {
            EntryRef::Memory(e, _) => e.last_event_seq(),
            EntryRef::File(v) => v.last_event_seq,
        }
    }

    /// Highest deletion marker in the segment (0 when none).
    pub(crate) fn deleted_to(&self) -> SequenceNr {
        match self {
            EntryRef::Memory(_, d) => *d,
            EntryRef::File(v) => v.deleted_to,
        }
    }

    /// Whether the id has no event in the segment (only deletion markers).
    pub(crate) fn has_no_events(&self) -> bool {
        match self {
            EntryRef::Memory(e, _) => e.events.is_empty(),
            EntryRef::File(v) => v.event_count() == 0,
        }
    }

    /// The events with a sequence number at least `from`, in order:
    /// (sequence number, offset in the segment).
    pub(crate) fn since(&self, from: SequenceNr) -> impl Iterator<Item = (SequenceNr, u32)> + '_ {
        let (memory, file) = match self {
            EntryRef::Memory(e, _) => (Some(e.events.since(from)), None),
            EntryRef::File(v) => (None, Some(v.since(from))),
        };
        memory
            .into_iter()
            .flatten()
            .chain(file.into_iter().flatten())
    }
}

/// A sealed segment's index read in place from its durable index file:
/// the file's bytes (mapped, with [`crate::storage::MmapStorage`]) and,
/// per entry, the low 32 bits of its id's [`pid_hash`] and the entry's
/// offset, sorted: 8 bytes of heap per id.
pub(crate) struct FileIndex {
    bytes: crate::storage::MappedFile,
    /// Where the entries end (the trailing CRC's offset).
    end: usize,
    /// (hash, entry offset), sorted.
    table: Box<[(u32, u32)]>,
}

impl FileIndex {
    /// Reads the entries of index file `bytes`, whose checksum was checked
    /// (the meta thread wrote these bytes; recovery decoded the file).
    /// `None` when the file is too large for 32-bit entry offsets (over
    /// 4 GiB: the segment then keeps its index in memory).
    ///
    /// # Errors
    /// [`format::FileDecodeError::Malformed`] when an entry runs past the
    /// end, or the file's bytes are not whole entries.
    pub(crate) fn new(
        bytes: crate::storage::MappedFile,
    ) -> Result<Option<FileIndex>, format::FileDecodeError> {
        if u32::try_from(bytes.len()).is_err() {
            return Ok(None);
        }
        Self::build(bytes, |_, _| true).map(Some)
    }

    /// Checks index file `bytes` as [`SegmentIndexFile::decode`] and
    /// [`events_in_order`] do (magic, version, checksum, every length, each
    /// id a valid persistence id, each entry's events in increasing
    /// sequence order ending at its last event's number) while it reads
    /// its entries in place: returns the file's summary fields (`entries`
    /// empty) and the index, with nothing allocated per entry but the
    /// table's 8 bytes. Recovery decoded each trusted file whole before
    /// (an id and an event list allocated per entry, then dropped) and
    /// read it a second time for the table. `None` when the file is too
    /// large for 32-bit entry offsets (the caller decodes it whole).
    ///
    /// # Errors
    /// The [`format::FileDecodeError`] that decoding it would give.
    pub(crate) fn checked(
        bytes: crate::storage::MappedFile,
    ) -> Result<Option<(SegmentIndexFile, FileIndex)>, format::FileDecodeError> {
        if u32::try_from(bytes.len()).is_err() {
            return Ok(None);
        }
        let summary = SegmentIndexFile::decode_summary(&bytes)?;
        let index = Self::build(bytes, |pid, v| {
            if pid.len() > crate::ids::MAX_PERSISTENCE_ID_LEN_BYTES {
                return false;
            }
            let mut last = SequenceNr(0);
            for i in 0..v.event_count() {
                let (seq, _) = v.event(i);
                if i > 0 && seq <= last {
                    return false;
                }
                last = seq;
            }
            v.last_event_seq == last
        })?;
        Ok(Some((summary, index)))
    }

    /// The one walk over a file below 4 GiB that builds its table: every
    /// entry read in place, `valid` asked of each (false: the entry is
    /// malformed), the entries required to end where the file's do.
    fn build(
        bytes: crate::storage::MappedFile,
        valid: impl Fn(&str, &format::IndexEntryView<'_>) -> bool,
    ) -> Result<FileIndex, format::FileDecodeError> {
        let (n, end) = format::index_entries(&bytes)?;
        // Each entry takes at least 31 bytes: the count is checked before
        // it sizes anything.
        if n as usize > (end - format::INDEX_ENTRIES_AT) / 31 {
            return Err(format::FileDecodeError::Malformed(
                format::INDEX_ENTRIES_AT as u64,
            ));
        }
        let mut table = Vec::with_capacity(n as usize);
        let mut at = format::INDEX_ENTRIES_AT;
        for _ in 0..n {
            let (pid, v, next) = entry_with_id(&bytes, at, end)?;
            if !valid(pid, &v) {
                return Err(format::FileDecodeError::Malformed(at as u64));
            }
            table.push((pid_hash(pid) as u32, at as u32));
            at = next;
        }
        if at != end {
            return Err(format::FileDecodeError::Malformed(at as u64));
        }
        table.sort_unstable();
        Ok(FileIndex {
            bytes,
            end,
            table: table.into_boxed_slice(),
        })
    }

    /// `pid`'s entry, if the segment holds it.
    ///
    /// # Errors
    /// [`format::FileDecodeError::Malformed`] when an entry the table
    /// points at cannot be read (the file changed on disk).
    pub(crate) fn get(
        &self,
        pid: &str,
    ) -> Result<Option<format::IndexEntryView<'_>>, format::FileDecodeError> {
        Ok(self.get_at(pid)?.map(|(_, v)| v))
    }

    /// `pid`'s entry and its byte offset in the file, if the segment holds
    /// it.
    ///
    /// # Errors
    /// As [`FileIndex::get`].
    pub(crate) fn get_at(
        &self,
        pid: &str,
    ) -> Result<Option<(u32, format::IndexEntryView<'_>)>, format::FileDecodeError> {
        let h = pid_hash(pid) as u32;
        let start = self.table.partition_point(|&(x, _)| x < h);
        for &(x, at) in &self.table[start..] {
            if x != h {
                break;
            }
            let (v, _) = format::index_entry_at(&self.bytes, at as usize, self.end)?;
            if v.pid == pid.as_bytes() {
                return Ok(Some((at, v)));
            }
        }
        Ok(None)
    }

    /// Where the entries end: the byte offset of the trailing CRC.
    pub(crate) fn entries_end(&self) -> u32 {
        // Below the file's length, below 4 GiB (`FileIndex::new`).
        self.end as u32
    }

    /// Counts the entries from byte `at` (an entry's start) that `covered`
    /// says no to, reading at most `budget` of them: where the count
    /// stopped ([`FileIndex::entries_end`] once every entry was read) and
    /// how many.
    ///
    /// # Errors
    /// As [`FileIndex::get`], and when `at` is not an entry's start.
    pub(crate) fn count_uncovered(
        &self,
        at: usize,
        budget: usize,
        mut covered: impl FnMut(&str, EntryRef<'_>) -> bool,
    ) -> Result<(u32, u32), format::FileDecodeError> {
        let (mut read, mut n) = (0, 0);
        let stopped = self.walk(at, |pid, v| {
            if read == budget {
                return false;
            }
            read += 1;
            if !covered(pid, EntryRef::File(v)) {
                n += 1;
            }
            true
        })?;
        // Below the file's length, below 4 GiB (`FileIndex::new`).
        Ok((stopped as u32, n))
    }

    /// Calls `f` with each entry, in the file's order (by id), until it
    /// returns false.
    ///
    /// # Errors
    /// As [`FileIndex::get`].
    fn for_each(
        &self,
        f: impl FnMut(&str, format::IndexEntryView<'_>) -> bool,
    ) -> Result<(), format::FileDecodeError> {
        self.walk(format::INDEX_ENTRIES_AT, f).map(drop)
    }

    /// Calls `f` with each entry from byte `at` (an entry's start), in the
    /// file's order, until it returns false; returns the offset of the
    /// entry it returned false for, or the entries' end.
    ///
    /// # Errors
    /// As [`FileIndex::get`], and when `at` is not an entry's start.
    fn walk(
        &self,
        mut at: usize,
        mut f: impl FnMut(&str, format::IndexEntryView<'_>) -> bool,
    ) -> Result<usize, format::FileDecodeError> {
        while at < self.end {
            let (pid, v, next) = entry_with_id(&self.bytes, at, self.end)?;
            if !f(pid, v) {
                return Ok(at);
            }
            at = next;
        }
        Ok(self.end)
    }
}

/// The index entry at byte `at` of index file `bytes` (entries ending at
/// `end`), its id as a string, and where the next entry starts.
///
/// # Errors
/// As [`format::index_entry_at`], and [`format::FileDecodeError::Malformed`]
/// when the id is not UTF-8.
fn entry_with_id(
    bytes: &[u8],
    at: usize,
    end: usize,
) -> Result<(&str, format::IndexEntryView<'_>, usize), format::FileDecodeError> {
    let (v, next) = format::index_entry_at(bytes, at, end)?;
    let pid =
        std::str::from_utf8(v.pid).map_err(|_| format::FileDecodeError::Malformed(at as u64))?;
    Ok((pid, v, next))
}

impl SealedSegment {
    /// `pid`'s entry in the segment's index, if it has one.
    ///
    /// # Errors
    /// As [`FileIndex::get`].
    pub(crate) fn entry(&self, pid: &str) -> Result<Option<EntryRef<'_>>, format::FileDecodeError> {
        match &self.file_index {
            Some(f) => Ok(f.get(pid)?.map(EntryRef::File)),
            None => Ok(self
                .index
                .pids
                .get(pid)
                .map(|e| EntryRef::Memory(e, self.index.deleted_to(pid)))),
        }
    }

    /// Calls `f` with each id of the segment and its entry, until it
    /// returns false.
    ///
    /// # Errors
    /// As [`FileIndex::get`].
    pub(crate) fn for_each_entry(
        &self,
        mut f: impl FnMut(&str, EntryRef<'_>) -> bool,
    ) -> Result<(), format::FileDecodeError> {
        match &self.file_index {
            Some(fi) => fi.for_each(|p, v| f(p, EntryRef::File(v))),
            None => {
                for (p, e) in self.index.pids.iter() {
                    if !f(
                        p.as_str(),
                        EntryRef::Memory(e, self.index.deleted_to(p.as_str())),
                    ) {
                        break;
                    }
                }
                Ok(())
            }
        }
    }

    /// Reads the index from `file` from now on: the in-memory index is
    /// replaced by its summary and returned (the caller may drop it on
    /// another thread: freeing a large index takes milliseconds).
    pub(crate) fn use_file_index(&mut self, file: FileIndex) -> std::sync::Arc<SegmentIndex> {
        let summary = std::sync::Arc::new(self.index.summary());
        self.file_index = Some(file);
        std::mem::replace(&mut self.index, summary)
    }
}

/// Per persistence id state (16 bytes: every id the journal holds has
/// one; how far an id's events are deleted is kept apart, in the
/// catalog's `deleted` map, as few ids delete).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct PidState {
    pub(crate) last_seq: SequenceNr,
    pub(crate) max_epoch: WriterEpoch,
}

const _: () = assert!(std::mem::size_of::<PidState>() == 16);

impl PidState {
    pub(crate) fn merge_checkpoint(&mut self, c: &PidCheckpoint) {
        self.last_seq = self.last_seq.max(c.last_seq);
        self.max_epoch = self.max_epoch.max(c.max_epoch);
    }
    /// Merges an id's entry `e` of a segment.
    pub(crate) fn merge_entry(&mut self, e: &EntryRef<'_>) {
        self.last_seq = self.last_seq.max(e.last_event_seq());
        self.max_epoch = self.max_epoch.max(e.max_epoch());
    }
}

/// How far `pid`'s events are deleted in `deleted` (0: none).
pub(crate) fn deleted_to(deleted: &PidMap<SequenceNr>, pid: &str) -> SequenceNr {
    deleted.get(pid).copied().unwrap_or_default()
}

/// Raises `pid`'s entry of `deleted` to `to` (no entry is made for 0).
pub(crate) fn raise_deleted(deleted: &mut PidMap<SequenceNr>, pid: &PersistenceId, to: SequenceNr) {
    if to > SequenceNr(0) {
        let d = deleted.entry_or_default(pid);
        *d = (*d).max(to);
    }
}

/// A torn tail that recovery cut (or, read-only, would cut).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    /// The segment id.
    pub segment: Lsn,
    /// The segment's file name.
    pub file: String,
    /// Offset where the valid records end (the file is cut there).
    pub offset: u64,
    /// Non-zero bytes after `offset` that were cut (0 when only a segment
    /// with a zeroed header was dropped), in bytes.
    pub bytes_cut: u64,
    /// What the first invalid bytes were.
    pub reason: String,
}

/// A cut made in [`RecoveryMode::Repair`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repair {
    /// The segment id.
    pub segment: Lsn,
    /// The segment's file name.
    pub file: String,
    /// Offset of the corruption.
    pub offset: u64,
    /// What was wrong.
    pub problem: String,
    /// Whether the whole file was removed (else it was cut at `offset`).
    pub removed_file: bool,
}

/// What recovery found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segments kept.
    pub segments: u64,
    /// Records (events and deletion markers) in them.
    pub records: u64,
    /// Bytes of records (headers included) in them.
    pub record_bytes: u64,
    /// Distinct persistence ids known.
    pub persistence_ids: u64,
    /// Segments whose records were scanned (those without an index file).
    pub scanned_segments: u64,
    /// The torn tail cut, if any.
    pub torn_tail: Option<TornTail>,
    /// Cuts made in repair mode.
    pub repairs: Vec<Repair>,
    /// Leftover files removed (temporary files, empty segments).
    pub removed_files: Vec<String>,
}

pub(crate) struct Recovered {
    pub(crate) segments: Vec<SealedSegment>,
    pub(crate) pids: PidMap<PidState>,
    /// How far each id with a deletion marker has its events deleted.
    pub(crate) deleted: PidMap<SequenceNr>,
    pub(crate) next_lsn: Lsn,
    pub(crate) max_segment_epoch: WriterEpoch,
    pub(crate) removed_up_to: Lsn,
    pub(crate) report: RecoveryReport,
    pub(crate) snapshot_files: Vec<String>,
    /// See [`recover_with`]: what an earlier reading read is not all there.
    pub(crate) replaced: bool,
}

fn io_err(op: impl Into<String>) -> impl FnOnce(std::io::Error) -> RecoveryError {
    let op = op.into();
    move |source| RecoveryError::Io { op, source }
}

/// Whether any of `later` segments holds a valid first record.
fn later_has_records(storage: &dyn Storage, later: &[(Lsn, String)]) -> bool {
    later.iter().any(|(_, name)| {
        let f = match storage.open_segment(name, false) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
            // Unknown: it may hold acknowledged records (the caller would
            // remove it with the segment before).
            Err(_) => return true,
        };
        let v = f.view();
        SegmentHeader::decode(&v).is_ok()
            && matches!(
                decode_record(&v, format::SEGMENT_HEADER_LEN_BYTES as u64),
                Decoded::Record(_)
            )
    })
}

/// Recovers `storage`. With `writable`, torn tails are cut, leftovers
/// removed and index files written for scanned segments; otherwise nothing
/// is changed. With `full_scan`, every segment is scanned even when it has
/// an index file. With `live_writer` (a read-only view of a directory that
/// another process may be appending to), bad bytes in the newest segment are
/// the writer's record in progress: they end the view as a torn tail instead
/// of failing the open, because a reader cannot tell a record being written
/// from a corrupt one there.
pub(crate) fn recover(
    storage: &dyn Storage,
    mode: RecoveryMode,
    full_scan: bool,
    writable: bool,
    live_writer: bool,
) -> Result<Recovered, RecoveryError> {
    recover_with(storage, mode, full_scan, writable, live_writer, None)
}

/// What an earlier recovery of the same directory read, for
/// [`recover_with`] to reuse instead of reading it again (a read-only view
/// brought up to date: `JournalReader::refresh`).
pub(crate) struct Earlier {
    /// The sealed segments it read through their index files: a durable
    /// index file does not change, nor does its segment, so each is reused
    /// as it is while it is still there, its entries already in `pids`.
    pub(crate) segments: std::collections::BTreeMap<Lsn, SealedSegment>,
    /// The per-id state it built (the state of an id only ever rises, so
    /// what is read again is merged into it).
    pub(crate) pids: PidMap<PidState>,
    /// How far each id's events were deleted.
    pub(crate) deleted: PidMap<SequenceNr>,
    /// Every record at or below this LSN was read then (its `next_lsn` less
    /// one): a segment removed since that it never read holds records
    /// above it, so the checkpoint is read again only when it covers a
    /// removal above it.
    pub(crate) seen_up_to: Lsn,
    /// Every segment it read (scanned or through its index file), as it
    /// read it: what must still be there (see [`Seen`]).
    pub(crate) read: std::collections::BTreeMap<Lsn, Seen>,
    /// The checkpoint's `removed_up_to_lsn` then (it never decreases).
    pub(crate) removed_up_to: Lsn,
}

/// What a reading saw of one segment: its header bytes (a copy: a map of
/// a file rewritten in place shows the new bytes), where its records ended
/// and the CRC32C of the 64 bytes before.
pub(crate) struct Seen {
    pub(crate) records: u64,
    pub(crate) last_lsn: Lsn,
    header: Option<Vec<u8>>,
    end: u64,
    crc: Option<u32>,
}

impl Seen {
    pub(crate) fn of(s: &SealedSegment) -> Seen {
        let v = s.file.get().map(|f| f.view());
        let v = v.as_deref();
        Seen {
            records: s.index.records,
            last_lsn: s.index.last_lsn,
            header: v
                .and_then(|v| v.get(..format::SEGMENT_HEADER_LEN_BYTES))
                .map(<[u8]>::to_vec),
            end: s.index.end_offset,
            crc: v.and_then(|v| tail_crc(v, s.index.end_offset)),
        }
    }

    /// Whether `v` (the segment now) still holds what was read.
    fn holds(&self, v: &[u8]) -> bool {
        self.records == 0
            || (self.header.as_deref() == v.get(..format::SEGMENT_HEADER_LEN_BYTES)
                && self.crc.is_some()
                && tail_crc(v, self.end) == self.crc)
    }
}

/// What [`recover_once`] checks the directory against (see [`Earlier`]):
/// the segments read, the checkpoint's `removed_up_to_lsn` and the last
/// LSN read then.
type Check = (std::collections::BTreeMap<Lsn, Seen>, Lsn, Lsn);

/// The fingerprint [`Seen`] keeps of a segment's records ending
/// at `end`.
pub(crate) fn tail_crc(bytes: &[u8], end: u64) -> Option<u32> {
    let end = usize::try_from(end).ok()?;
    let start = end.saturating_sub(64).max(format::SEGMENT_HEADER_LEN_BYTES);
    bytes.get(start..end).map(crc32c::crc32c)
}

/// As [`recover`], reusing what `earlier` read of the same directory (see
/// [`Earlier`]): its sealed segments read through index files are not read
/// again, only checked against their neighbours, and only the segments it
/// did not read through an index file (the live writer's newest among them)
/// are read and merged into its per-id state; the checkpoint is merged
/// only when it covers a segment removed after `earlier.seen_up_to`.
/// Without `earlier`, everything is read.
///
/// A read-only view of a live writer's directory (`live_writer`, not
/// `writable`) reads it again from its listing when a segment it listed is
/// gone when it opens it (the writer removed it meanwhile, after writing the
/// checkpoint that covers it), up to 64 times (a writer removing tiny
/// segments under load made 8 too few in a test); before, a view opened
/// then failed, and the engine refused to start the entity whose recovery
/// opened it.
pub(crate) fn recover_with(
    storage: &dyn Storage,
    mode: RecoveryMode,
    full_scan: bool,
    writable: bool,
    live_writer: bool,
    earlier: Option<Earlier>,
) -> Result<Recovered, RecoveryError> {
    let (mut reuse, mut base, check) = match earlier {
        Some(e) => (
            e.segments,
            Some((e.pids, e.deleted, e.seen_up_to)),
            Some((e.read, e.removed_up_to, e.seen_up_to)),
        ),
        None => (Default::default(), None, None),
    };
    let mut attempts = 0;
    loop {
        let mut out = Vec::new();
        let mut reused = BTreeSet::new();
        let r = recover_once(
            storage,
            (mode, full_scan, writable, live_writer),
            &mut reuse,
            &mut base,
            check.as_ref(),
            (&mut out, &mut reused),
        );
        // A failed attempt gives back what it took (the next one checks
        // it, and reuses it, again).
        for s in out {
            if reused.contains(&s.index.id) {
                reuse.insert(s.index.id, s);
            }
        }
        match r {
            Err(RecoveryError::Io { source, .. })
                if live_writer
                    && !writable
                    && source.kind() == std::io::ErrorKind::NotFound
                    && attempts < 64 =>
            {
                attempts += 1;
            }
            r => return r,
        }
    }
}

/// One reading of [`recover_with`]. What it takes from `reuse` and `base`
/// is gone if it fails (a segment taken from `reuse` is then read again
/// through its index file, and merged again into `base`, which only rises).
#[allow(clippy::type_complexity)]
fn recover_once(
    storage: &dyn Storage,
    (mode, full_scan, writable, live_writer): (RecoveryMode, bool, bool, bool),
    reuse: &mut std::collections::BTreeMap<Lsn, SealedSegment>,
    base: &mut Option<(PidMap<PidState>, PidMap<SequenceNr>, Lsn)>,
    check: Option<&Check>,
    (out, reused): (&mut Vec<SealedSegment>, &mut BTreeSet<Lsn>),
) -> Result<Recovered, RecoveryError> {
    // Whether the directory no longer holds what `earlier` read (replaced,
    // or records it read cut): the caller then reads it afresh.
    let mut replaced = false;
    let names = storage
        .list()
        .map_err(io_err("listing the journal directory"))?;
    let mut report = RecoveryReport::default();
    let mut snapshot_files = Vec::new();
    let mut segs: Vec<(Lsn, String)> = Vec::new();
    let mut idx: BTreeSet<Lsn> = BTreeSet::new();
    for n in &names {
        if n.ends_with(TMP_SUFFIX) {
            if writable {
                storage.remove(n).map_err(io_err(format!("removing {n}")))?;
                report.removed_files.push(n.clone());
            }
        } else if let Some(id) = parse_numbered_name(n, SEGMENT_SUFFIX) {
            segs.push((id, n.clone()));
        } else if let Some(id) = parse_numbered_name(n, INDEX_SUFFIX) {
            idx.insert(id);
        } else if n.ends_with(format::SNAPSHOT_SUFFIX) {
            snapshot_files.push(n.clone());
        }
    }
    segs.sort();
    let checkpoint = if names.iter().any(|n| n == CHECKPOINT_NAME) {
        let b = storage
            .read_file(CHECKPOINT_NAME)
            .map_err(io_err("reading the checkpoint"))?;
        let seen_up_to = base.as_ref().map(|b| b.2);
        let decoded = match (Checkpoint::decode_summary(&b), seen_up_to) {
            // Every segment it covers was read before: its summary is
            // enough (its per-id state is in the earlier state already).
            // (Not when it covers the last record read: a segment gone
            // then is checked against its per-id state, below.)
            (Ok(c), Some(seen)) if c.removed_up_to_lsn < seen => Ok(c),
            _ => Checkpoint::decode(&b),
        };
        match decoded {
            Ok(c) => c,
            Err(format::FileDecodeError::UnsupportedVersion(version)) => {
                return Err(RecoveryError::UnsupportedVersion {
                    file: CHECKPOINT_NAME.to_string(),
                    version,
                })
            }
            Err(reason) => {
                return Err(RecoveryError::BadFile {
                    file: CHECKPOINT_NAME.to_string(),
                    reason,
                })
            }
        }
    } else {
        Checkpoint::default()
    };

    // Segment epochs must not decrease in LSN order. The checkpoint's
    // epoch (which may come from a removed segment) only feeds the
    // directory-level fencing below, not this order check.
    let mut prev_epoch = WriterEpoch(0);
    // Segments may be removed out of order (any segment whose records are
    // all deleted), so the checkpoint's `removed_up_to_lsn` only bounds the
    // next LSN; overlaps are checked between the segments present.
    let mut next_expected = Lsn(1);
    // (`out`, and `reused`: segments reused from `earlier`, their entries
    // in its state, are the caller's.)
    let mut i = 0;
    while i < segs.len() {
        let (id, name) = segs[i].clone();
        let later = &segs[i + 1..];
        let idx_exists = idx.contains(&id);
        let file = storage
            .open_segment(&name, false)
            .map_err(io_err(format!("opening {name}")))?;
        let len = file.len_bytes();

        // A segment read before (with records) must be the same file, and
        // hold still the records read from it; one it never read cannot
        // start at or below the last record it read.
        if let Some((read, _, seen)) = check {
            match read.get(&id) {
                Some(s) => replaced |= !s.holds(&file.view()),
                None => replaced |= id <= *seen,
            }
        }
        let prev = reuse.remove(&id);
        // Read before through its index file: reused as it is, after the
        // same checks of its place among its neighbours.
        if let Some(earlier) =
            prev.filter(|s| idx_exists && !full_scan && s.file_index.is_some() && s.name == name)
        {
            let ix = &earlier.index;
            if ix.epoch >= prev_epoch && id >= next_expected && len >= ix.end_offset {
                prev_epoch = prev_epoch.max(ix.epoch);
                next_expected = Lsn(ix.last_lsn.0 + 1);
                reused.insert(id);
                out.push(earlier);
                i += 1;
                continue;
            }
        }

        // Trusted path: a segment with a valid index file is not scanned.
        if idx_exists && !full_scan {
            let mapped = storage.map_file(&index_name(id)).ok();
            // Checked in place into its table, with nothing allocated per
            // entry; a file over 4 GiB is decoded whole and kept in memory.
            let (decoded, in_place) = match mapped {
                Some(b) if u32::try_from(b.len()).is_ok() => match FileIndex::checked(b) {
                    Ok(Some((summary, index))) => (Some(summary), Some(index)),
                    _ => (None, None),
                },
                Some(b) => (SegmentIndexFile::decode(&b).ok(), None),
                None => (None, None),
            };
            // The header is still checked (64 bytes): a damaged header
            // sends the segment down the scanning path, which names it.
            let header_ok = SegmentHeader::decode(&file.view()).is_ok_and(|h| {
                h.segment_id == id
                    && decoded
                        .as_ref()
                        .is_some_and(|f| f.writer_epoch == h.writer_epoch)
            });
            if let Some(f) = decoded.filter(|_| header_ok) {
                if f.segment_id == id
                    && f.writer_epoch >= prev_epoch
                    && id >= next_expected
                    && events_in_order(&f)
                {
                    if len < f.end_offset && mode == RecoveryMode::Strict {
                        return Err(RecoveryError::Corrupt {
                            segment: id,
                            file: name,
                            offset: len,
                            kind: CorruptionKind::Truncated {
                                len_bytes: len,
                                end_offset: f.end_offset,
                            },
                        });
                    }
                    if len >= f.end_offset {
                        prev_epoch = prev_epoch.max(f.writer_epoch);
                        next_expected = Lsn(f.last_lsn.0 + 1);
                        // Read in place from now on, or kept in memory
                        // when the file cannot be read that way.
                        let index = SegmentIndex::from_file(f);
                        out.push(SealedSegment {
                            name,
                            index: std::sync::Arc::new(index),
                            file_index: in_place,
                            has_index_file: true,
                            file: OnceLock::from(file),
                        });
                        i += 1;
                        continue;
                    }
                }
            }
        }

        report.scanned_segments += 1;
        let view = file.view();
        let header = match SegmentHeader::decode(&view) {
            Ok(h) => h,
            Err(HeaderError::UnsupportedVersion { version }) => {
                return Err(RecoveryError::UnsupportedVersion {
                    file: name,
                    version,
                })
            }
            Err(e) => {
                let all_zero = view.iter().all(|&b| b == 0);
                drop(view);
                drop(file);
                // (Or shorter than a header, all zero: created under its
                // name, not yet sized, when its writer stopped or as a
                // view lists it.)
                let unwritten = matches!(e, HeaderError::Zeroed | HeaderError::TooShort { .. });
                if unwritten && all_zero && !later_has_records(storage, later) {
                    // A segment created just before a crash whose header
                    // never reached the disk: nothing in it was ever
                    // acknowledged. Drop it and everything after it.
                    report.torn_tail = Some(TornTail {
                        segment: id,
                        file: name.clone(),
                        offset: 0,
                        bytes_cut: 0,
                        reason: e.to_string(),
                    });
                    drop_from(storage, &segs[i..], writable, &mut report)?;
                    break;
                }
                if mode == RecoveryMode::Strict {
                    return Err(RecoveryError::Corrupt {
                        segment: id,
                        file: name,
                        offset: 0,
                        kind: CorruptionKind::Header(e),
                    });
                }
                report.repairs.push(Repair {
                    segment: id,
                    file: name,
                    offset: 0,
                    problem: CorruptionKind::Header(e).to_string(),
                    removed_file: true,
                });
                drop_from(storage, &segs[i..], writable, &mut report)?;
                break;
            }
        };
        if header.segment_id != id {
            let kind = CorruptionKind::NameMismatch {
                found: header.segment_id,
            };
            if mode == RecoveryMode::Strict {
                return Err(RecoveryError::Corrupt {
                    segment: id,
                    file: name,
                    offset: 16,
                    kind,
                });
            }
            drop(view);
            drop(file);
            report.repairs.push(Repair {
                segment: id,
                file: name,
                offset: 16,
                problem: kind.to_string(),
                removed_file: true,
            });
            drop_from(storage, &segs[i..], writable, &mut report)?;
            break;
        }
        if header.writer_epoch < prev_epoch || id < next_expected {
            let err = if header.writer_epoch < prev_epoch {
                RecoveryError::StaleSegment {
                    segment: id,
                    file: name.clone(),
                    epoch: header.writer_epoch,
                    newer_epoch: prev_epoch,
                }
            } else {
                RecoveryError::Overlap {
                    segment: id,
                    file: name.clone(),
                    expected: next_expected,
                }
            };
            if mode == RecoveryMode::Strict {
                return Err(err);
            }
            drop(view);
            drop(file);
            report.repairs.push(Repair {
                segment: id,
                file: name.clone(),
                offset: 0,
                problem: err.to_string(),
                removed_file: true,
            });
            if writable {
                storage
                    .remove(&name)
                    .map_err(io_err(format!("removing {name}")))?;
                let _ = storage.remove(&index_name(id));
            }
            i += 1;
            continue;
        }
        let mut index = SegmentIndex::new(id, header.writer_epoch);
        let summary = scan_records(&view, id, |r| index.add_view(r));
        let problem = match summary.stop {
            ScanStop::Clean => None,
            ScanStop::Invalid {
                offset,
                reason,
                valid_record_after,
                last_nonzero_end,
            } => Some((
                offset,
                CorruptionKind::Record(reason),
                valid_record_after,
                last_nonzero_end,
            )),
            ScanStop::LsnGap {
                offset,
                expected,
                found,
            } => Some((
                offset,
                CorruptionKind::LsnGap { expected, found },
                true,
                format::last_nonzero_end(&view),
            )),
        };
        drop(view);
        prev_epoch = prev_epoch.max(header.writer_epoch);
        let Some((offset, kind, valid_after, last_nonzero_end)) = problem else {
            next_expected = Lsn(index.last_lsn.0 + 1);
            out.push(SealedSegment {
                name,
                index: std::sync::Arc::new(index),
                file_index: None,
                has_index_file: false,
                file: OnceLock::from(file),
            });
            i += 1;
            continue;
        };
        drop(file);
        // Records after the bad bytes in this segment, or in a later
        // segment when this one has an index file (it was sealed durably,
        // so later records may have been acknowledged), make it corruption.
        // Without an index file this segment was never sealed durably and
        // no later record was ever acknowledged (FORMAT.md, "Durability").
        let in_progress = live_writer && !writable && later.is_empty();
        let corrupt =
            !in_progress && (valid_after || (idx_exists && later_has_records(storage, later)));
        if corrupt && mode == RecoveryMode::Strict {
            return Err(RecoveryError::Corrupt {
                segment: id,
                file: name,
                offset,
                kind,
            });
        }
        if corrupt {
            report.repairs.push(Repair {
                segment: id,
                file: name.clone(),
                offset,
                problem: kind.to_string(),
                removed_file: false,
            });
        } else {
            report.torn_tail = Some(TornTail {
                segment: id,
                file: name.clone(),
                offset,
                bytes_cut: last_nonzero_end.saturating_sub(offset),
                reason: kind.to_string(),
            });
        }
        if writable {
            storage
                .truncate(&name, offset)
                .map_err(io_err(format!("truncating {name}")))?;
            if idx_exists {
                let _ = storage.remove(&index_name(id));
            }
        }
        let file = storage
            .open_segment(&name, false)
            .map_err(io_err(format!("opening {name}")))?;
        out.push(SealedSegment {
            name,
            index: std::sync::Arc::new(index),
            file_index: None,
            has_index_file: false,
            file: OnceLock::from(file),
        });
        drop_from(storage, &segs[i + 1..], writable, &mut report)?;
        break;
    }

    if let Some((read, removed_before, seen)) = check {
        // A segment read before that is gone was removed by the writer
        // only once the checkpoint covered it: its LSNs, and (when the
        // checkpoint covers the last record read, its per-id state then
        // decoded) every id's state in it.
        for (id, s) in read {
            if s.records == 0 || segs.iter().any(|(i, _)| i == id) {
                continue;
            }
            if s.last_lsn > checkpoint.removed_up_to_lsn {
                replaced = true;
            } else if checkpoint.removed_up_to_lsn >= *seen {
                replaced |= !covered_by(&checkpoint, reuse.get(id));
            }
        }
        if checkpoint.removed_up_to_lsn < *removed_before {
            replaced = true;
        }
    }
    let out = std::mem::take(out);
    let (mut pids, mut deleted) = match base.take() {
        Some((pids, deleted, _)) => (pids, deleted),
        None => (PidMap::default(), PidMap::default()),
    };
    for (p, c) in &checkpoint.pids {
        pids.entry_or_default(p).merge_checkpoint(c);
        raise_deleted(&mut deleted, p, c.deleted_to);
    }
    let mut next_lsn = next_expected.max(Lsn(checkpoint.removed_up_to_lsn.0 + 1));
    let no_ids: PidMap<()> = PidMap::default();
    for s in &out {
        next_lsn = next_lsn.max(Lsn(s.index.last_lsn.0 + 1));
        report.records += s.index.records;
        report.record_bytes += s
            .index
            .end_offset
            .saturating_sub(format::SEGMENT_HEADER_LEN_BYTES as u64);
        if reused.contains(&s.index.id) {
            continue;
        }
        // An id that is not a valid persistence id can only be in an index
        // file that changed on disk after recovery decoded it.
        let mut valid = true;
        s.for_each_entry(|p, e| {
            let Some(st) = pids.entry_or_default_str(p, &no_ids) else {
                valid = false;
                return false;
            };
            st.merge_entry(&e);
            if e.deleted_to() > SequenceNr(0) {
                if let Some(d) = deleted.entry_or_default_str(p, &pids) {
                    *d = (*d).max(e.deleted_to());
                }
            }
            true
        })
        .and_then(|()| {
            valid
                .then_some(())
                .ok_or(format::FileDecodeError::Malformed(0))
        })
        .map_err(|reason| RecoveryError::BadFile {
            file: index_name(s.index.id),
            reason,
        })?;
    }
    report.segments = out.len() as u64;
    report.persistence_ids = pids.len() as u64;
    Ok(Recovered {
        segments: out,
        pids,
        deleted,
        next_lsn,
        max_segment_epoch: prev_epoch.max(checkpoint.max_segment_epoch),
        removed_up_to: checkpoint.removed_up_to_lsn,
        report,
        snapshot_files,
        replaced,
    })
}

/// Whether `checkpoint` (decoded whole, its ids in order) holds the state
/// of `s`'s ids, a segment it says was removed: of up to about 64 of them,
/// spread over the segment (a binary search each: a refresh on the data
/// core checks a quarter of a million ids in microseconds, not 0.1 s, and a
/// different journal's checkpoint holds none of them).
fn covered_by(checkpoint: &Checkpoint, s: Option<&SealedSegment>) -> bool {
    let Some(s) = s else { return false };
    let stride = (s.index.records / 64).max(1);
    let mut i = 0u64;
    let mut ok = true;
    let r = s.for_each_entry(|p, e| {
        i += 1;
        if !(i - 1).is_multiple_of(stride) {
            return true;
        }
        ok = checkpoint
            .pids
            .binary_search_by(|(q, _)| q.as_str().cmp(p))
            .is_ok_and(|i| {
                let c = &checkpoint.pids[i].1;
                c.last_seq >= e.last_event_seq()
                    && c.max_epoch >= e.max_epoch()
                    && c.deleted_to >= e.deleted_to()
            });
        ok
    });
    ok && r.is_ok()
}

/// Removes `segs` (and their index files) when writable; records them in
/// the report either way.
fn drop_from(
    storage: &dyn Storage,
    segs: &[(Lsn, String)],
    writable: bool,
    report: &mut RecoveryReport,
) -> Result<(), RecoveryError> {
    for (id, name) in segs {
        if writable {
            storage
                .remove(name)
                .map_err(io_err(format!("removing {name}")))?;
            let _ = storage.remove(&index_name(*id));
        }
        report.removed_files.push(name.clone());
    }
    if writable && !segs.is_empty() {
        storage
            .sync_dir()
            .map_err(io_err("syncing the journal directory"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `bytes` with its trailing checksum made right again.
    fn resealed(mut bytes: Vec<u8>) -> Vec<u8> {
        let at = bytes.len() - 4;
        let crc = crc32c::crc32c(&bytes[..at]);
        bytes[at..].copy_from_slice(&crc.to_le_bytes());
        bytes
    }

    #[test]
    fn an_index_file_checked_in_place_is_refused_exactly_when_decoding_refuses_it() {
        use rand::{Rng, SeedableRng};
        let mut index = SegmentIndex::new(Lsn(1), WriterEpoch(2));
        let mut lsn = 1;
        for i in 0..40u64 {
            let pid = PersistenceId::new(&format!("t|{i}")).unwrap();
            let hash = pid_hash(pid.as_str());
            for s in 1..=(1 + i % 3) {
                index.add(
                    &pid,
                    hash,
                    RecordKind::Event,
                    SequenceNr(s + i),
                    WriterEpoch(2),
                    Lsn(lsn),
                    64 + lsn * 40,
                    40,
                );
                lsn += 1;
            }
        }
        let good = index.encode_file();
        let accepts = |b: &[u8]| -> Option<SegmentIndexFile> {
            SegmentIndexFile::decode(b).ok().filter(events_in_order)
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (mut refused, mut accepted) = (0, 0);
        for round in 0..4000 {
            let mut b = good.clone();
            // Bytes changed in the entries (and, for some, the checksum
            // left wrong), or the file cut or lengthened.
            match round % 4 {
                0 => {
                    let at = rng.gen_range(format::INDEX_ENTRIES_AT..b.len() - 4);
                    b[at] = rng.gen();
                    b = resealed(b);
                }
                1 => {
                    let at = rng.gen_range(0..b.len());
                    b[at] ^= 1 << rng.gen_range(0..8);
                }
                2 => {
                    let cut = rng.gen_range(20..b.len());
                    b.truncate(cut);
                    b = resealed(b);
                }
                _ => {
                    let at = rng.gen_range(format::INDEX_ENTRIES_AT..b.len() - 12);
                    // An event's sequence number (or whatever is there)
                    // set to a small value: out of order, or a last event
                    // that no longer matches.
                    b[at..at + 8].copy_from_slice(&rng.gen_range(0u64..4).to_le_bytes());
                    b = resealed(b);
                }
            }
            let want = accepts(&b);
            let got = FileIndex::checked(Box::new(b.clone())).ok().flatten();
            assert_eq!(want.is_some(), got.is_some(), "round {round}");
            if let (Some(want), Some((summary, file))) = (want, got) {
                accepted += 1;
                assert_eq!(
                    summary,
                    SegmentIndexFile {
                        entries: Vec::new(),
                        ..want.clone()
                    }
                );
                for (pid, e) in &want.entries {
                    // A changed id may repeat another (neither check looks
                    // for repeats); only an id's single entry is compared.
                    if want.entries.iter().filter(|(p, _)| p == pid).count() > 1 {
                        continue;
                    }
                    let v = file.get(pid.as_str()).unwrap().unwrap();
                    assert_eq!(v.last_event_seq, e.last_event_seq);
                    assert_eq!(v.since(SequenceNr(0)).collect::<Vec<_>>(), e.events);
                }
            } else {
                refused += 1;
            }
        }
        assert!(
            refused > 1000 && accepted > 100,
            "{refused} refused, {accepted} accepted"
        );
    }

    #[test]
    fn an_index_encoded_straight_from_memory_has_the_bytes_of_its_file_form() {
        let mut index = SegmentIndex::new(Lsn(17), WriterEpoch(3));
        let mut off = format::SEGMENT_HEADER_LEN_BYTES as u64;
        let mut lsn = 17;
        // 5,000 ids (past a map's split into partitions) in an order
        // unlike their sorted one; every seventh with several events, every
        // eleventh with a deletion marker, every thirteenth with only one.
        for i in 0..5_000u64 {
            let pid = PersistenceId::new(&format!("t|{}", (i * 7919) % 5_000)).unwrap();
            let hash = pid_hash(pid.as_str());
            let events = if i % 13 == 0 {
                0
            } else if i % 7 == 0 {
                1 + i % 5
            } else {
                1
            };
            let mut add = |kind, seq, epoch| {
                index.add(
                    &pid,
                    hash,
                    kind,
                    SequenceNr(seq),
                    WriterEpoch(epoch),
                    Lsn(lsn),
                    off,
                    40,
                );
                lsn += 1;
                off += 40;
            };
            for s in 1..=events {
                add(RecordKind::Event, s + (i << 20), 3 + s % 2);
            }
            if i % 11 == 0 || events == 0 {
                add(RecordKind::Deletion, (i << 20) + events, 5);
            }
        }
        let file = index.to_file();
        assert_eq!(file.entries.len(), 5_000);
        let bytes = index.encode_file();
        assert_eq!(bytes, file.encode());
        assert_eq!(SegmentIndexFile::decode(&bytes).unwrap(), file);
    }

    #[test]
    fn an_event_list_grows_clones_and_compares_as_the_vec_it_holds() {
        let mut e = Events::default();
        let mut want = Vec::new();
        for i in 1..=1000u64 {
            // Sequence numbers above 2^32 keep their high half inline.
            let seq = SequenceNr(i + (1 << 33));
            e.push(seq, i as u32 * 7);
            want.push((seq, i as u32 * 7));
            assert_eq!(e.last(), Some((seq, i as u32 * 7)));
        }
        assert!(matches!(e, Events::Many(_)));
        assert_eq!(e.iter().collect::<Vec<_>>(), want);
        let from = SequenceNr(500 + (1 << 33));
        assert_eq!(e.since(from).count(), 501);
        let c = e.clone();
        assert_eq!(c, e);
        drop(e);
        assert_eq!(c.iter().collect::<Vec<_>>(), want);
        assert_eq!(format!("{c:?}").matches("SequenceNr").count(), 1000);
        let mut one = Events::default();
        one.push(SequenceNr(u64::MAX), u32::MAX);
        assert_eq!(one.last(), Some((SequenceNr(u64::MAX), u32::MAX)));
        assert_ne!(one, c);
    }

    #[test]
    fn an_entry_keeps_its_events_in_order_inline_then_boxed_and_round_trips_its_file_form() {
        let mut e = PidEntry::default();
        assert!(e.events.is_empty());
        assert_eq!(e.last_event_seq(), SequenceNr(0));
        e.events.push(SequenceNr(3), 100);
        assert!(matches!(e.events, Events::One(_)));
        assert_eq!(e.last_event_seq(), SequenceNr(3));
        assert_eq!(e.events.since(SequenceNr(4)).count(), 0);
        assert_eq!(
            e.events.since(SequenceNr(3)).collect::<Vec<_>>(),
            [(SequenceNr(3), 100)]
        );
        e.events.push(SequenceNr(5), 200);
        e.events.push(SequenceNr(9), 300);
        e.max_epoch = WriterEpoch(7);
        assert_eq!(e.last_event_seq(), SequenceNr(9));
        assert_eq!(
            e.events.since(SequenceNr(4)).collect::<Vec<_>>(),
            [(SequenceNr(5), 200), (SequenceNr(9), 300)]
        );
        assert_eq!(e.events.iter().count(), 3);
        let file = e.to_index_entry(SequenceNr(2));
        assert_eq!(file.last_event_seq, SequenceNr(9));
        assert_eq!(file.deleted_to, SequenceNr(2));
        assert_eq!(file.events.len(), 3);
        assert_eq!(PidEntry::from_index_entry(file), e);
    }
}
