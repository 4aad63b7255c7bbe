//! Sealed segments' indexes read in place from their index files (once
//! durable) instead of kept in memory: replay, deletion, removal and
//! reopening give what they gave before, and an index file damaged after it
//! was checked fails a replay with a typed error instead of a panic or a
//! wrong answer.

mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use common::{opts, payload, pid};
use shardline_journal::{
    CorruptionKind, Durability, Journal, JournalReader, Lsn, ReplayError, SequenceNr, WriterEpoch,
};

const IDS: usize = 40;
const ROUNDS: u64 = 30;

fn name(i: usize) -> String {
    format!("counter|{i}")
}

/// Every index file of `dir`, by name.
fn index_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "idx"))
        .collect();
    v.sort();
    v
}

/// Appends rounds `rounds` (one event of each of the `IDS` ids each) and
/// returns the last LSN.
fn append_rounds(j: &mut Journal, rounds: std::ops::RangeInclusive<u64>) -> Lsn {
    let mut last = Lsn(0);
    for round in rounds {
        for i in 0..IDS {
            let id = name(i);
            last = j
                .append(
                    &pid(&id),
                    SequenceNr(round),
                    WriterEpoch(1),
                    &payload(&id, round),
                )
                .unwrap();
        }
    }
    last
}

/// (sequence number, payload) of each record.
fn pairs(v: Vec<shardline_journal::Record>) -> Vec<(u64, Vec<u8>)> {
    v.into_iter()
        .map(|r| (r.sequence_nr.0, r.payload))
        .collect()
}

/// Checks that every id replays exactly `expected` (its sequence numbers
/// and payloads from `from`).
fn check_replay(
    replay: impl Fn(&str, SequenceNr) -> Result<Vec<(u64, Vec<u8>)>, ReplayError>,
    expected: &BTreeMap<String, (u64, u64)>,
) {
    for (id, &(from, to)) in expected {
        let got = replay(id, SequenceNr(1)).unwrap();
        let want: Vec<_> = (from..=to).map(|s| (s, payload(id, s))).collect();
        assert_eq!(got, want, "{id}");
        // From the middle too: the index's binary search by sequence.
        let mid = (from + to) / 2;
        let got = replay(id, SequenceNr(mid)).unwrap();
        assert_eq!(got.len() as u64, to - mid + 1, "{id} from {mid}");
    }
}

#[test]
fn replay_deletion_and_removal_read_sealed_segments_through_their_index_files() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::None, 1)).unwrap();
    let ids: Vec<_> = (0..IDS).map(|i| pid(&name(i))).collect();
    // (first kept, last) sequence number per id.
    let mut expected: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for first in (1..=ROUNDS).step_by(5) {
        let last = append_rounds(&mut j, first..=first + 4);
        // Let the index files of the segments sealed so far be written,
        // so that later appends take them up in place of memory.
        j.wait_durable(last).unwrap();
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in &ids {
        expected.insert(p.as_str().to_string(), (1, ROUNDS));
    }
    assert!(j.segment_count() > 20, "{} segments", j.segment_count());
    // Deletion markers land in the active segment, later sealed and read
    // in place as well.
    for p in ids.iter().step_by(4) {
        j.delete_to(p, SequenceNr(10), WriterEpoch(1)).unwrap();
        expected.get_mut(p.as_str()).unwrap().0 = 11;
    }
    for round in ROUNDS + 1..=ROUNDS + 10 {
        let last = append_rounds(&mut j, round..=round);
        j.wait_durable(last).unwrap();
        std::thread::sleep(Duration::from_millis(10));
    }
    for v in expected.values_mut() {
        v.1 = ROUNDS + 10;
    }
    check_replay(|id, from| j.replay(&pid(id), from).map(pairs), &expected);

    // Snapshots of every id at its last event make every sealed segment
    // obsolete: each is found covered through its index (whichever form it
    // is in) and removed.
    let before = j.segment_count();
    for p in &ids {
        j.save_snapshot(p, SequenceNr(ROUNDS + 10), WriterEpoch(1), b"s")
            .unwrap();
    }
    let after = j.segment_count();
    assert!(after < before / 4, "{after} segments left of {before}");
    for p in &ids {
        let r = j.recover(p).unwrap();
        assert_eq!(r.snapshot.unwrap().sequence_nr, SequenceNr(ROUNDS + 10));
        assert!(r.events.is_empty());
    }
    // Events after the snapshots, then a reopen: the checkpoint written at
    // the removal and the index files give the same state.
    for p in &ids {
        j.append(
            p,
            SequenceNr(ROUNDS + 11),
            WriterEpoch(1),
            &payload(p.as_str(), ROUNDS + 11),
        )
        .unwrap();
    }
    j.close().unwrap();
    let (j, rep) = Journal::open(dir.path(), opts(4096, Durability::None, 1)).unwrap();
    assert_eq!(rep.persistence_ids, IDS as u64);
    for p in &ids {
        assert_eq!(j.highest_sequence_nr(p), SequenceNr(ROUNDS + 11));
        let r = j.recover(p).unwrap();
        assert_eq!(r.snapshot.unwrap().sequence_nr, SequenceNr(ROUNDS + 10));
        assert_eq!(r.events.len(), 1);
        assert_eq!(r.events[0].payload, payload(p.as_str(), ROUNDS + 11));
    }
    j.close().unwrap();
}

#[test]
fn reopened_and_read_only_journals_replay_through_index_files() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 1)).unwrap();
    append_rounds(&mut j, 1..=ROUNDS);
    let expected: BTreeMap<_, _> = (0..IDS).map(|i| (name(i), (1, ROUNDS))).collect();
    j.close().unwrap();
    assert!(index_files(dir.path()).len() > 20);

    let (j, rep) = Journal::open(dir.path(), opts(4096, Durability::Always, 1)).unwrap();
    assert_eq!(rep.scanned_segments, 1, "only the segment that was open");
    check_replay(|id, from| j.replay(&pid(id), from).map(pairs), &expected);
    let reader = JournalReader::open(dir.path()).unwrap();
    assert_eq!(reader.persistence_ids().len(), IDS);
    check_replay(
        |id, from| reader.replay(&pid(id), from).map(pairs),
        &expected,
    );
}

#[test]
fn an_index_file_damaged_after_it_was_checked_fails_replay_with_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 1)).unwrap();
    append_rounds(&mut j, 1..=ROUNDS);
    j.close().unwrap();
    // Opened: every sealed segment's index file was checked (checksum,
    // order) and is read in place from now on.
    let (j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 1)).unwrap();
    let idx = index_files(dir.path())[2].clone();
    let len = std::fs::metadata(&idx).unwrap().len();
    // Overwrite its entries in place (the mapping sees it) with 0xff: an
    // id length of 65535 runs past the file's end in every entry.
    let f = std::fs::OpenOptions::new().write(true).open(&idx).unwrap();
    f.write_all_at(&vec![0xffu8; (len - 60 - 4) as usize], 60)
        .unwrap();
    drop(f);
    let idx_name = idx.file_name().unwrap().to_string_lossy().to_string();
    // The ids with events in that segment fail, naming its index file;
    // the others (not in its table) replay whole.
    let mut damaged = 0;
    for i in 0..IDS {
        match j.replay(&pid(&name(i)), SequenceNr(1)) {
            Ok(v) => assert_eq!(v.len() as u64, ROUNDS, "{}", name(i)),
            Err(ReplayError::Corrupt { file, kind, .. }) => {
                assert_eq!(file, idx_name);
                assert!(matches!(kind, CorruptionKind::IndexFile(_)), "{kind:?}");
                damaged += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(damaged >= 1, "no replay read the damaged index");
    j.close().unwrap();
    // A reopen finds the file's checksum broken and scans the segment
    // instead: every event is there.
    let (j, rep) = Journal::open(dir.path(), opts(4096, Durability::Always, 1)).unwrap();
    assert_eq!(rep.scanned_segments, 2, "the damaged one and the last");
    for i in 0..IDS {
        let got = j.replay(&pid(&name(i)), SequenceNr(1)).unwrap();
        assert_eq!(got.len() as u64, ROUNDS);
    }
}

/// A memory storage whose index-file writes wait while its gate is closed.
#[derive(Clone, Debug)]
struct IndexGate {
    inner: shardline_journal::storage::MemoryStorage,
    open: std::sync::Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
}

impl IndexGate {
    fn set_open(&self, open: bool) {
        *self.open.0.lock().unwrap() = open;
        self.open.1.notify_all();
    }

    fn count(&self, ext: &str) -> usize {
        use shardline_journal::storage::Storage;
        let list = self.inner.list().unwrap();
        list.iter().filter(|n| n.ends_with(ext)).count()
    }
}

impl shardline_journal::storage::Storage for IndexGate {
    fn list(&self) -> std::io::Result<Vec<String>> {
        self.inner.list()
    }
    fn create_segment(
        &self,
        name: &str,
        size_bytes: u64,
    ) -> std::io::Result<Box<dyn shardline_journal::storage::SegmentFile>> {
        self.inner.create_segment(name, size_bytes)
    }
    fn open_segment(
        &self,
        name: &str,
        writable: bool,
    ) -> std::io::Result<Box<dyn shardline_journal::storage::SegmentFile>> {
        self.inner.open_segment(name, writable)
    }
    fn truncate(&self, name: &str, len_bytes: u64) -> std::io::Result<()> {
        self.inner.truncate(name, len_bytes)
    }
    fn read_file(&self, name: &str) -> std::io::Result<Vec<u8>> {
        self.inner.read_file(name)
    }
    fn map_file(&self, name: &str) -> std::io::Result<shardline_journal::storage::MappedFile> {
        self.inner.map_file(name)
    }
    fn write_file_durable(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        if name.ends_with(".idx") {
            let (open, cond) = &*self.open;
            let mut g = open.lock().unwrap();
            while !*g {
                g = cond.wait(g).unwrap();
            }
        }
        self.inner.write_file_durable(name, bytes)
    }
    fn write_file(&self, name: &str, bytes: &[u8]) -> std::io::Result<()> {
        self.inner.write_file(name, bytes)
    }
    fn sync_file(&self, name: &str) -> std::io::Result<()> {
        self.inner.sync_file(name)
    }
    fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        self.inner.rename(from, to)
    }
    fn remove(&self, name: &str) -> std::io::Result<()> {
        self.inner.remove(name)
    }
    fn sync_dir(&self) -> std::io::Result<()> {
        self.inner.sync_dir()
    }
}

#[test]
fn an_idle_journal_takes_up_index_files_and_removes_covered_segments_when_maintained() {
    let gate = IndexGate {
        inner: shardline_journal::storage::MemoryStorage::new(),
        open: Default::default(),
    };
    let (mut j, _) = Journal::open_with_storage(
        std::sync::Arc::new(gate.clone()),
        opts(4096, Durability::None, 1),
    )
    .unwrap();
    let ids: Vec<_> = (0..IDS).map(|i| pid(&name(i))).collect();
    // No index file can be written: every sealed segment keeps its index
    // in memory, where snapshots do not count its ids covered.
    let last = append_rounds(&mut j, 1..=ROUNDS);
    j.wait_durable(last).unwrap();
    for p in &ids {
        j.save_snapshot(p, SequenceNr(ROUNDS), WriterEpoch(1), b"s")
            .unwrap();
    }
    let sealed = j.segment_count() - 1;
    assert!(sealed > 20, "{sealed} sealed segments");
    // Then the index files are written, and the journal is left idle.
    gate.set_open(true);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while gate.count(".idx") < sealed {
        assert!(std::time::Instant::now() < deadline, "index files");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(j.segment_count(), sealed + 1, "nothing changes by itself");
    // What a data core's timer does: each call takes up what is offered and
    // counts a step; every sealed segment is found covered and removed.
    while j.segment_count() > 1 || gate.count(".seg") > 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} segments left",
            j.segment_count()
        );
        j.maintain();
        std::thread::sleep(Duration::from_millis(5));
    }
    for p in &ids {
        let r = j.recover(p).unwrap();
        assert_eq!(r.snapshot.unwrap().sequence_nr, SequenceNr(ROUNDS));
        assert!(r.events.is_empty());
        assert_eq!(j.highest_sequence_nr(p), SequenceNr(ROUNDS));
    }
    // Appends go on after the removals; a reopen sees the same.
    append_rounds(&mut j, ROUNDS + 1..=ROUNDS + 1);
    j.close().unwrap();
    let (j, rep) = Journal::open_with_storage(
        std::sync::Arc::new(gate.inner.clone()),
        opts(4096, Durability::None, 1),
    )
    .unwrap();
    assert_eq!(rep.persistence_ids, IDS as u64);
    for p in &ids {
        let r = j.recover(p).unwrap();
        assert_eq!(r.snapshot.unwrap().sequence_nr, SequenceNr(ROUNDS));
        assert_eq!(r.events.len(), 1);
    }
}
