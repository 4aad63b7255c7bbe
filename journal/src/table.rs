//! The snapshot table: the small snapshots of every id of one journal in
//! one file of slot pairs (`journal/FORMAT.md`, "Snapshot table").
//!
//! An id gets a pair of [`TABLE_SLOT_BYTES`] slots at its first save,
//! appended at the table's end. A save writes the slot that does not hold
//! the id's last durable snapshot, or, when the id's previous write is not
//! synced yet, that same slot again: a write torn by a crash never touches
//! the only durable copy. The journal's meta thread writes slots through
//! one open handle and syncs the table once per batch of saves, instead of
//! a file, an `fdatasync`, an exchange and a directory `fsync` per save
//! (and two inodes per id).
//!
//! The state here (which pair is whose, which slot is the newest, whether
//! it is synced) is written by the meta thread and read by the journal's
//! own thread for recovery; both go through one mutex, taken once per save
//! and per read.

use std::io;
use std::sync::{Mutex, MutexGuard};

use crate::format::{
    decode_table_slot, encode_table_slot, Snapshot, TableSlot, SNAPSHOT_TABLE_NAME,
    TABLE_PAIR_BYTES, TABLE_SLOT_BYTES,
};
use crate::ids::PersistenceId;
use crate::pidmap::{pid_hash, PidMap};
use crate::storage::{Storage, TableFile};

/// Pairs read per call while the table is scanned at open (512 KiB).
const SCAN_PAIRS: usize = 1024;

/// The pairs a table of `len` bytes holds (a last one cut short counts).
///
/// # Errors
/// When there are more than 2^32.
fn pairs_in(len: u64) -> io::Result<u32> {
    u32::try_from(len.div_ceil(TABLE_PAIR_BYTES as u64))
        .map_err(|_| io::Error::other("the snapshot table has more than 2^32 pairs"))
}

/// Reads the pairs of `file` from pair `from` to byte `len`, keeping in
/// `best` each id's pair with its newest write (its serial), raising
/// `next_serial` above every serial read and counting unreadable slots in
/// `scan`; `intern` gives the journal's own copy of an id. Returns the
/// first pair of the last run of pairs without a valid slot (the pair
/// after the last when the last has one).
///
/// # Errors
/// The I/O error of reading the file.
fn scan_pairs(
    file: &dyn TableFile,
    (from, len): (u32, u64),
    intern: &impl Fn(&PersistenceId) -> Option<PersistenceId>,
    best: &mut PidMap<(Pair, u64)>,
    next_serial: &mut u64,
    scan: &mut TableScan,
    bad: &mut Vec<u32>,
) -> io::Result<u32> {
    let mut buf = vec![0u8; TABLE_PAIR_BYTES * SCAN_PAIRS];
    let mut index: u32 = from;
    let mut offset = u64::from(from) * TABLE_PAIR_BYTES as u64;
    let mut rescan_from = from;
    while offset < len {
        let want = buf
            .len()
            .min(usize::try_from(len - offset).unwrap_or(usize::MAX));
        let n = file.read_at(offset, &mut buf[..want])?;
        if n == 0 {
            break;
        }
        for pair in buf[..n].chunks(TABLE_PAIR_BYTES) {
            let mut valid = false;
            let mut unreadable = false;
            for (slot, bytes) in pair.chunks(TABLE_SLOT_BYTES).enumerate() {
                match decode_table_slot(bytes) {
                    TableSlot::Empty => {}
                    TableSlot::Unreadable => {
                        scan.unreadable_slots += 1;
                        unreadable = true;
                    }
                    TableSlot::Valid(s, serial) => {
                        valid = true;
                        *next_serial = (*next_serial).max(serial.saturating_add(1));
                        let pid = intern(&s.persistence_id).unwrap_or(s.persistence_id);
                        let hash = pid_hash(pid.as_str());
                        let found = Pair {
                            index,
                            latest: slot as u8,
                            synced: true,
                        };
                        let e = best.get_or_insert_with(hash, &pid, || (found, serial));
                        // The newest write wins, within a pair and (an
                        // id is given one pair, but a damaged table may
                        // show two) across pairs.
                        if serial > e.1 {
                            *e = (found, serial);
                        }
                    }
                }
            }
            if !valid || unreadable {
                bad.push(index);
            }
            index = index.saturating_add(1);
            if valid {
                rescan_from = index;
            }
        }
        offset += n as u64;
    }
    Ok(rescan_from)
}

/// An id's pair: its index, the slot written last, and whether that write
/// is synced.
#[derive(Debug, Clone, Copy)]
struct Pair {
    index: u32,
    latest: u8,
    synced: bool,
}

#[derive(Default)]
struct State {
    pairs: PidMap<Pair>,
    next_pair: u32,
    /// The serial of the next write (one above the highest in the file).
    next_serial: u64,
    /// Ids written since the last sync.
    unsynced: Vec<PersistenceId>,
    /// The first pair of the file's last run of pairs with no valid slot
    /// when it was last scanned (pairs being written then): a read-only
    /// table reads again from there ([`SnapshotTable::scan_new_pairs`]).
    rescan_from: u32,
    /// The pairs before `rescan_from` that had no valid slot or an
    /// unreadable one at the last scan (a write seen half done, or
    /// damage): read again by [`SnapshotTable::scan_new_pairs`].
    recheck: Vec<u32>,
}

/// What reading an id's pair found.
#[derive(Debug)]
pub(crate) struct TableRead {
    /// The newest snapshot of the id in its pair.
    pub(crate) snapshot: Option<Snapshot>,
    /// A slot of the pair did not decode: a write torn before it was
    /// synced (then the other slot is the id's last durable snapshot), or
    /// damage to a durable one. Recovery from such a pair checks that the
    /// events after the snapshot are all there.
    pub(crate) unreadable_slot: bool,
}

/// One journal's snapshot table (see the module doc).
pub(crate) struct SnapshotTable {
    file: Box<dyn TableFile>,
    state: Mutex<State>,
}

impl std::fmt::Debug for SnapshotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SnapshotTable")
            .field("pairs", &self.lock().next_pair)
            .finish()
    }
}

/// What the scan at open found besides the pairs.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct TableScan {
    /// Slots that did not decode (count).
    pub(crate) unreadable_slots: u64,
}

impl SnapshotTable {
    /// Opens the snapshot table of `storage` and scans it; a `writable`
    /// one is created when missing (its directory entry is durable after
    /// the caller's directory sync). `intern` gives the journal's own copy
    /// of an id when it has one, so the table shares it.
    ///
    /// Returns `None` when the storage has no tables, or (not `writable`)
    /// when the directory has no table.
    ///
    /// # Errors
    /// The I/O error of opening or reading the file.
    pub(crate) fn open(
        storage: &dyn Storage,
        writable: bool,
        intern: impl Fn(&PersistenceId) -> Option<PersistenceId>,
    ) -> io::Result<Option<(SnapshotTable, TableScan)>> {
        let file = match storage.open_table(SNAPSHOT_TABLE_NAME, writable) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::Unsupported => return Ok(None),
            Err(e) if !writable && e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let len = file.len_bytes()?;
        let next_pair = pairs_in(len)?;
        let mut best: PidMap<(Pair, u64)> = PidMap::default();
        let mut next_serial = 1u64;
        let mut scan = TableScan::default();
        let mut recheck = Vec::new();
        let rescan_from = scan_pairs(
            &*file,
            (0, len),
            &intern,
            &mut best,
            &mut next_serial,
            &mut scan,
            &mut recheck,
        )?;
        recheck.retain(|&i| i < rescan_from);
        if writable {
            // What the scan found counts as synced from here on (the next
            // write of an id goes to its other slot): make it so. A write of
            // the last run that a crash caught before its sync is still in
            // the page cache and reads as valid; without this sync the next
            // save could overwrite the id's last durable slot while that
            // write is not durable either.
            file.sync()?;
        }
        let pairs = best.into_entries().map(|(pid, (p, _))| (pid, p)).collect();
        let table = SnapshotTable {
            file,
            state: Mutex::new(State {
                pairs,
                next_pair,
                next_serial,
                unsynced: Vec::new(),
                rescan_from,
                recheck,
            }),
        };
        Ok(Some((table, scan)))
    }

    /// Reads the pairs a live writer added since this (read-only) table was
    /// opened or last read this way, from its first pair that had no valid
    /// slot then (a pair being written) to the file's end now, and takes up
    /// their ids (`intern` as for [`SnapshotTable::open`]). An id's pair
    /// never moves and a read decodes both its slots, so the pairs read
    /// before stay right.
    ///
    /// # Errors
    /// The I/O error of reading the file.
    pub(crate) fn scan_new_pairs(
        &self,
        intern: impl Fn(&PersistenceId) -> Option<PersistenceId>,
    ) -> io::Result<TableScan> {
        let len = self.file.len_bytes()?;
        let next_pair = pairs_in(len)?;
        let (from, old_recheck) = {
            let st = self.lock();
            (st.rescan_from, st.recheck.clone())
        };
        let mut best: PidMap<(Pair, u64)> = PidMap::default();
        let mut next_serial = 1u64;
        let mut scan = TableScan::default();
        let mut recheck = Vec::new();
        let pair = TABLE_PAIR_BYTES as u64;
        for i in old_recheck {
            scan_pairs(
                &*self.file,
                (i, (u64::from(i) + 1) * pair),
                &intern,
                &mut best,
                &mut next_serial,
                &mut scan,
                &mut recheck,
            )?;
        }
        let rescan_from = scan_pairs(
            &*self.file,
            (from, len),
            &intern,
            &mut best,
            &mut next_serial,
            &mut scan,
            &mut recheck,
        )?;
        recheck.retain(|&i| i < rescan_from);
        let mut st = self.lock();
        for (pid, (pair, serial)) in best.into_entries() {
            let hash = pid_hash(pid.as_str());
            match st.pairs.get_mut_pid(hash, &pid) {
                // A damaged table may show an id in two pairs: the newest
                // write wins, as at open.
                Some(known) if known.index != pair.index => {
                    if serial > self.newest_serial(known.index, &pid)? {
                        *known = pair;
                    }
                }
                Some(_) => {}
                None => {
                    st.pairs.insert(pid, pair);
                }
            }
        }
        st.next_pair = st.next_pair.max(next_pair);
        st.next_serial = st.next_serial.max(next_serial);
        st.rescan_from = rescan_from;
        st.recheck = recheck;
        Ok(scan)
    }

    /// The highest write serial of `pid` in pair `index` (0: none).
    fn newest_serial(&self, index: u32, pid: &PersistenceId) -> io::Result<u64> {
        let mut buf = [0u8; TABLE_PAIR_BYTES];
        let n = self
            .file
            .read_at(u64::from(index) * TABLE_PAIR_BYTES as u64, &mut buf)?;
        Ok(buf[..n]
            .chunks(TABLE_SLOT_BYTES)
            .filter_map(|b| match decode_table_slot(b) {
                TableSlot::Valid(s, serial) if s.persistence_id == *pid => Some(serial),
                _ => None,
            })
            .max()
            .unwrap_or(0))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads `pid`'s pair: its newest valid snapshot of `pid` (none, with
    /// `unreadable_slot`, when the pair no longer holds a valid one).
    ///
    /// # Errors
    /// The I/O error of the read.
    pub(crate) fn read(&self, pid: &PersistenceId) -> io::Result<TableRead> {
        let index = match self.lock().pairs.get(pid.as_str()) {
            Some(p) => p.index,
            None => {
                return Ok(TableRead {
                    snapshot: None,
                    unreadable_slot: false,
                })
            }
        };
        let mut buf = [0u8; TABLE_PAIR_BYTES];
        let n = self
            .file
            .read_at(u64::from(index) * TABLE_PAIR_BYTES as u64, &mut buf)?;
        let mut out = TableRead {
            snapshot: None,
            unreadable_slot: false,
        };
        let mut newest = 0u64;
        for bytes in buf[..n].chunks(TABLE_SLOT_BYTES) {
            match decode_table_slot(bytes) {
                TableSlot::Empty => {}
                TableSlot::Unreadable => out.unreadable_slot = true,
                TableSlot::Valid(s, serial) => {
                    if s.persistence_id == *pid && (out.snapshot.is_none() || serial > newest) {
                        newest = serial;
                        out.snapshot = Some(s);
                    }
                }
            }
        }
        // The pair held a snapshot of `pid` when the table was opened (or
        // written): one that reads as none now is damage.
        if out.snapshot.is_none() {
            out.unreadable_slot = true;
        }
        Ok(out)
    }

    /// Writes snapshot encoding `encoded` (at most
    /// [`crate::format::TABLE_SNAPSHOT_MAX_BYTES`]) of `pid`: into a new
    /// pair at the end for an id without one, else into the slot that does
    /// not hold its last synced snapshot (the same slot again while the
    /// previous write is not synced). Durable after [`SnapshotTable::sync`].
    /// Called by one thread (the journal's meta thread).
    ///
    /// # Errors
    /// The I/O error of the write (the journal is then poisoned), or a
    /// table of 2^32 pairs.
    pub(crate) fn write(&self, pid: &PersistenceId, encoded: &[u8]) -> io::Result<()> {
        let mut guard = self.lock();
        let State {
            pairs,
            next_pair,
            next_serial,
            unsynced,
            ..
        } = &mut *guard;
        let hash = pid_hash(pid.as_str());
        let existing = pairs.get_pid(hash, pid).copied();
        let (index, slot) = match existing {
            Some(p) if p.synced => (p.index, 1 - p.latest),
            Some(p) => (p.index, p.latest),
            None if *next_pair == u32::MAX => {
                return Err(io::Error::other(
                    "the snapshot table is full (2^32 - 1 pairs)",
                ))
            }
            // A new pair's first write goes to slot 0.
            None => (*next_pair, 0),
        };
        let bytes = encode_table_slot(encoded, *next_serial).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "a snapshot of {} bytes does not fit a table slot",
                    encoded.len()
                ),
            )
        })?;
        let offset =
            u64::from(index) * TABLE_PAIR_BYTES as u64 + u64::from(slot) * TABLE_SLOT_BYTES as u64;
        self.file.write_at(offset, &bytes)?;
        *next_serial += 1;
        if existing.is_none() {
            *next_pair += 1;
        }
        // Listed once per sync: only when it goes from synced to not.
        if existing.is_none_or(|p| p.synced) {
            unsynced.push(pid.clone());
        }
        let p = pairs.get_or_insert_with(hash, pid, || Pair {
            index,
            latest: slot,
            synced: false,
        });
        p.latest = slot;
        p.synced = false;
        Ok(())
    }

    /// Makes every write so far durable (`fdatasync`), then lets the next
    /// write of each id written go to its other slot.
    ///
    /// # Errors
    /// The I/O error of the flush (the journal is then poisoned).
    pub(crate) fn sync(&self) -> io::Result<()> {
        self.file.sync()?;
        let mut guard = self.lock();
        let State {
            pairs, unsynced, ..
        } = &mut *guard;
        for pid in unsynced.drain(..) {
            let hash = pid_hash(pid.as_str());
            if let Some(p) = pairs.get_mut_pid(hash, &pid) {
                p.synced = true;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::TABLE_SNAPSHOT_MAX_BYTES;
    use crate::ids::{SequenceNr, WriterEpoch};
    use crate::storage::MemoryStorage;

    fn pid(s: &str) -> PersistenceId {
        PersistenceId::new(s).unwrap()
    }

    fn snap(p: &PersistenceId, seq: u64, data: &[u8]) -> Vec<u8> {
        Snapshot {
            persistence_id: p.clone(),
            sequence_nr: SequenceNr(seq),
            writer_epoch: WriterEpoch(1),
            timestamp_ms: 0,
            data: data.to_vec(),
        }
        .encode()
    }

    fn open(s: &MemoryStorage) -> (SnapshotTable, TableScan) {
        SnapshotTable::open(s, true, |_| None).unwrap().unwrap()
    }

    fn slot_bytes(s: &MemoryStorage, pair: usize, slot: usize) -> Vec<u8> {
        let off = pair * TABLE_PAIR_BYTES + slot * TABLE_SLOT_BYTES;
        s.with_file_mut(SNAPSHOT_TABLE_NAME, |b| {
            b.get(off..off + TABLE_SLOT_BYTES)
                .map(<[u8]>::to_vec)
                .unwrap_or_default()
        })
        .unwrap()
    }

    #[test]
    fn writes_alternate_slots_only_after_a_sync_and_a_reopen_finds_the_newest() {
        let s = MemoryStorage::new();
        let (t, _) = open(&s);
        let (a, b) = (pid("counter|a"), pid("counter|b"));
        t.write(&a, &snap(&a, 100, b"a100")).unwrap();
        t.write(&b, &snap(&b, 100, b"b100")).unwrap();
        // Not synced: the next write of `a` overwrites the same slot.
        t.write(&a, &snap(&a, 200, b"a200")).unwrap();
        assert!(matches!(
            decode_table_slot(&slot_bytes(&s, 0, 1)),
            TableSlot::Empty
        ));
        t.sync().unwrap();
        // Synced: the next one goes to the other slot, the synced one stays.
        t.write(&a, &snap(&a, 300, b"a300")).unwrap();
        match decode_table_slot(&slot_bytes(&s, 0, 0)) {
            TableSlot::Valid(x, _) => assert_eq!(x.data, b"a200"),
            other => panic!("{other:?}"),
        }
        assert_eq!(t.read(&a).unwrap().snapshot.unwrap().data, b"a300");
        assert_eq!(t.read(&b).unwrap().snapshot.unwrap().data, b"b100");
        assert!(t.read(&pid("counter|c")).unwrap().snapshot.is_none());
        drop(t);
        let (t, scan) = open(&s);
        assert_eq!(scan.unreadable_slots, 0);
        assert_eq!(
            t.read(&a).unwrap().snapshot.unwrap().sequence_nr,
            SequenceNr(300)
        );
        assert_eq!(
            t.read(&b).unwrap().snapshot.unwrap().sequence_nr,
            SequenceNr(100)
        );
        // The reopened table starts from synced pairs: `a`'s next write
        // leaves its newest (slot 1) alone.
        t.write(&a, &snap(&a, 400, b"a400")).unwrap();
        match decode_table_slot(&slot_bytes(&s, 0, 1)) {
            TableSlot::Valid(x, _) => assert_eq!(x.data, b"a300"),
            other => panic!("{other:?}"),
        }
        // A new id gets the next pair.
        let c = pid("counter|c");
        t.write(&c, &snap(&c, 5, b"c5")).unwrap();
        assert!(matches!(
            decode_table_slot(&slot_bytes(&s, 2, 0)),
            TableSlot::Valid(..)
        ));
    }

    #[test]
    fn a_torn_slot_leaves_the_other_and_is_reported() {
        let s = MemoryStorage::new();
        let (t, _) = open(&s);
        let a = pid("counter|a");
        t.write(&a, &snap(&a, 100, b"a100")).unwrap();
        t.sync().unwrap();
        t.write(&a, &snap(&a, 200, b"a200")).unwrap();
        drop(t);
        // A crash tore the unsynced write of 200 (slot 1).
        s.with_file_mut(SNAPSHOT_TABLE_NAME, |b| {
            b[TABLE_SLOT_BYTES + 40] ^= 0xff;
        });
        let (t, scan) = open(&s);
        assert_eq!(scan.unreadable_slots, 1);
        let r = t.read(&a).unwrap();
        assert_eq!(r.snapshot.unwrap().sequence_nr, SequenceNr(100));
        assert!(r.unreadable_slot);
    }

    #[test]
    fn a_slot_holds_encodings_up_to_its_limit() {
        let s = MemoryStorage::new();
        let (t, _) = open(&s);
        let a = pid("counter|a");
        let base = snap(&a, 1, b"").len();
        let data = vec![7u8; TABLE_SNAPSHOT_MAX_BYTES - base];
        let enc = snap(&a, 1, &data);
        assert_eq!(enc.len(), TABLE_SNAPSHOT_MAX_BYTES);
        t.write(&a, &enc).unwrap();
        t.sync().unwrap();
        drop(t);
        let (t, _) = open(&s);
        assert_eq!(t.read(&a).unwrap().snapshot.unwrap().data, data);
    }
}
