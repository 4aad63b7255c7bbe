//! Snapshot saves do not flush on the caller's thread, and a snapshot only
//! counts once durable: until the journal's meta thread made it durable,
//! the previous snapshot and every event stay on disk.

mod common;

use std::io;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::{opts, payload, pid};
use shardline_journal::storage::{MemoryStorage, SegmentFile, Storage};
use shardline_journal::{Durability, Journal, SequenceNr, WriterEpoch};

/// A memory storage whose `sync_file` waits while the gate is closed and
/// records the name of every thread that calls it and of every file it
/// syncs; and which records, at each segment's removal, the highest event
/// sequence number in it beside that of the snapshot in place then.
#[derive(Debug, Clone)]
struct Gated {
    inner: MemoryStorage,
    gate: Arc<(Mutex<bool>, Condvar)>,
    sync_threads: Arc<Mutex<Vec<String>>>,
    synced: Arc<Mutex<Vec<String>>>,
    removals: Arc<Mutex<Vec<(u64, u64)>>>,
}

impl Gated {
    fn new(inner: MemoryStorage) -> Gated {
        Gated {
            inner,
            gate: Arc::new((Mutex::new(true), Condvar::new())),
            sync_threads: Arc::default(),
            synced: Arc::default(),
            removals: Arc::default(),
        }
    }

    /// The highest event sequence number in segment `name`, and the
    /// sequence number of the snapshot file in place (0 when none).
    fn coverage_at_removal(&self, name: &str) -> (u64, u64) {
        use shardline_journal::format::{decode_record, Decoded, SEGMENT_HEADER_LEN_BYTES};
        use shardline_journal::{RecordKind, Snapshot};
        let bytes = self.inner.read_file(name).unwrap_or_default();
        let (mut off, mut max_event) = (SEGMENT_HEADER_LEN_BYTES as u64, 0);
        while let Decoded::Record(r) = decode_record(&bytes, off) {
            if r.kind == RecordKind::Event {
                max_event = max_event.max(r.sequence_nr.0);
            }
            off += r.len_bytes;
        }
        let snap = self
            .inner
            .list()
            .unwrap()
            .iter()
            .filter(|n| n.ends_with(".snap"))
            .filter_map(|n| Snapshot::decode(&self.inner.read_file(n).ok()?).ok())
            .map(|s| s.sequence_nr.0)
            .max()
            .unwrap_or(0);
        (max_event, snap)
    }

    fn set_open(&self, open: bool) {
        *self.gate.0.lock().unwrap() = open;
        self.gate.1.notify_all();
    }
}

impl Storage for Gated {
    fn list(&self) -> io::Result<Vec<String>> {
        self.inner.list()
    }
    fn create_segment(&self, name: &str, size_bytes: u64) -> io::Result<Box<dyn SegmentFile>> {
        self.inner.create_segment(name, size_bytes)
    }
    fn open_segment(&self, name: &str, writable: bool) -> io::Result<Box<dyn SegmentFile>> {
        self.inner.open_segment(name, writable)
    }
    fn truncate(&self, name: &str, len_bytes: u64) -> io::Result<()> {
        self.inner.truncate(name, len_bytes)
    }
    fn read_file(&self, name: &str) -> io::Result<Vec<u8>> {
        self.inner.read_file(name)
    }
    fn map_file(&self, name: &str) -> io::Result<shardline_journal::storage::MappedFile> {
        self.inner.map_file(name)
    }
    fn write_file_durable(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.inner.write_file_durable(name, bytes)
    }
    fn write_file(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.inner.write_file(name, bytes)
    }
    fn sync_file(&self, name: &str) -> io::Result<()> {
        let me = std::thread::current().name().unwrap_or("?").to_string();
        self.sync_threads.lock().unwrap().push(me);
        self.synced.lock().unwrap().push(name.to_string());
        let (open, cond) = &*self.gate;
        let mut g = open.lock().unwrap();
        while !*g {
            g = cond.wait(g).unwrap();
        }
        self.inner.sync_file(name)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        if name.ends_with(".seg") {
            let c = self.coverage_at_removal(name);
            self.removals.lock().unwrap().push(c);
        }
        self.inner.remove(name)
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.inner.sync_dir()
    }
}

/// What a crash right now would leave: an independent copy of the files.
fn crash_copy(s: &MemoryStorage) -> MemoryStorage {
    let copy = MemoryStorage::new();
    for name in s.list().unwrap() {
        copy.write_file_durable(&name, &s.read_file(&name).unwrap())
            .unwrap();
    }
    copy
}

fn segments(s: &MemoryStorage) -> usize {
    s.list()
        .unwrap()
        .iter()
        .filter(|n| n.ends_with(".seg"))
        .count()
}

fn indexes(s: &MemoryStorage) -> usize {
    s.list()
        .unwrap()
        .iter()
        .filter(|n| n.ends_with(".idx"))
        .count()
}

#[test]
fn snapshot_is_made_durable_off_the_caller_and_segments_go_only_after_it() {
    let mem = MemoryStorage::new();
    let gated = Gated::new(mem.clone());
    let policy = Durability::Interval(Duration::from_millis(1));
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(gated.clone()), opts(4096, policy, 1)).unwrap();
    let a = pid("counter|a");
    let mut last = None;
    for seq in 1..=120 {
        last = Some(
            j.append(&a, SequenceNr(seq), WriterEpoch(1), &payload("a", seq))
                .unwrap(),
        );
    }
    j.wait_durable(last.unwrap()).unwrap();
    let before = segments(&mem);
    assert!(before >= 3, "events span several segments: {before}");

    // The meta thread cannot finish the snapshot while the gate is closed,
    // yet saving returns (the caller's thread never syncs).
    gated.set_open(false);
    j.save_snapshot(&a, SequenceNr(120), WriterEpoch(1), b"state@120")
        .unwrap();
    // This journal reads the new snapshot at once.
    let r = j.recover(&a).unwrap();
    assert_eq!(r.snapshot.unwrap().sequence_nr, SequenceNr(120));
    assert!(r.events.is_empty());
    // Wait until the meta thread is blocked in the snapshot's sync.
    while gated.sync_threads.lock().unwrap().is_empty() {
        std::thread::sleep(Duration::from_millis(1));
    }
    // Not durable yet: no snapshot file in place, and no segment removed.
    let names = mem.list().unwrap();
    assert!(
        !names.iter().any(|n| n.ends_with(".snap")),
        "snapshot in place before it is durable: {names:?}"
    );
    assert_eq!(
        segments(&mem),
        before,
        "a segment went before the snapshot was durable"
    );
    // A crash now loses nothing: every event is recovered.
    let (after_crash, _) =
        Journal::open_with_storage(Arc::new(crash_copy(&mem)), opts(4096, policy, 1)).unwrap();
    let r = after_crash.recover(&a).unwrap();
    assert!(r.snapshot.is_none());
    assert_eq!(
        r.events.iter().map(|e| e.sequence_nr.0).collect::<Vec<_>>(),
        (1..=120).collect::<Vec<_>>()
    );
    after_crash.close().unwrap();

    // Let it through; closing waits for the meta thread's queued work.
    gated.set_open(true);
    j.close().unwrap();
    let threads = gated.sync_threads.lock().unwrap().clone();
    assert!(
        threads.iter().all(|t| t == "journal-meta"),
        "snapshot synced on {threads:?}"
    );
    let names = mem.list().unwrap();
    assert!(names.iter().any(|n| n.ends_with(".snap")), "{names:?}");
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    assert!(
        segments(&mem) < before,
        "obsolete segments were not removed once the snapshot was durable"
    );
    let (j, _) = Journal::open_with_storage(Arc::new(mem), opts(4096, policy, 1)).unwrap();
    let r = j.recover(&a).unwrap();
    assert_eq!(r.snapshot.unwrap().data, b"state@120");
    assert!(r.events.is_empty());
    j.close().unwrap();
}

#[test]
fn a_snapshot_that_cannot_be_made_durable_poisons_and_keeps_the_events() {
    use shardline_journal::storage::FaultyStorage;
    use std::sync::atomic::Ordering;
    let mem = MemoryStorage::new();
    let faulty = FaultyStorage::new(mem.clone());
    let faults = faulty.faults();
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(faulty), opts(4096, Durability::None, 1)).unwrap();
    let a = pid("counter|a");
    for seq in 1..=120 {
        j.append(&a, SequenceNr(seq), WriterEpoch(1), &payload("a", seq))
            .unwrap();
    }
    let last = j.append(&a, SequenceNr(121), WriterEpoch(1), b"x").unwrap();
    j.wait_durable(last).unwrap();
    // Let the meta thread write the index of every sealed segment first.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while indexes(&mem) + 1 < segments(&mem) {
        assert!(
            std::time::Instant::now() < deadline,
            "index files not written"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let before = segments(&mem);
    faults.fail_sync.store(true, Ordering::SeqCst);
    // Accepted (the caller does not sync); the failure comes later, through
    // the journal's poisoning.
    j.save_snapshot(&a, SequenceNr(121), WriterEpoch(1), b"s")
        .unwrap();
    let err = j.close().unwrap_err();
    assert!(err.to_string().contains("snapshot"), "{err}");
    assert_eq!(
        segments(&mem),
        before,
        "segments removed without a durable snapshot"
    );
    faults.fail_sync.store(false, Ordering::SeqCst);
    let (j, _) =
        Journal::open_with_storage(Arc::new(mem), opts(4096, Durability::None, 1)).unwrap();
    let r = j.recover(&a).unwrap();
    // The snapshot goes to the snapshot table, whose write is in place
    // though its sync failed (a memory storage loses nothing): found or
    // not, the state is whole, and every event was kept.
    match &r.snapshot {
        None => assert_eq!(r.events.len(), 121),
        Some(s) => {
            assert_eq!(s.sequence_nr, SequenceNr(121));
            assert!(r.events.is_empty());
        }
    }
    assert_eq!(j.replay(&a, SequenceNr(1)).unwrap().len(), 121);
    j.close().unwrap();
}

#[test]
fn a_save_overtaken_in_the_queue_is_not_written_and_no_segment_goes_before_its_covering_snapshot_is_durable(
) {
    let mem = MemoryStorage::new();
    let gated = Gated::new(mem.clone());
    let policy = Durability::Interval(Duration::from_millis(1));
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(gated.clone()), opts(4096, policy, 1)).unwrap();
    let a = pid("counter|a");
    let mut last = None;
    for seq in 1..=300 {
        last = Some(
            j.append(&a, SequenceNr(seq), WriterEpoch(1), &payload("a", seq))
                .unwrap(),
        );
    }
    j.wait_durable(last.unwrap()).unwrap();
    assert!(segments(&mem) >= 6, "events span many segments");
    gated.synced.lock().unwrap().clear();

    // The meta thread blocks in the first save's sync; two more saves of
    // the same entity queue behind it, each with the segment removal its
    // coverage allows.
    gated.set_open(false);
    j.save_snapshot(&a, SequenceNr(100), WriterEpoch(1), b"state@100")
        .unwrap();
    while gated.synced.lock().unwrap().is_empty() {
        std::thread::sleep(Duration::from_millis(1));
    }
    j.save_snapshot(&a, SequenceNr(200), WriterEpoch(1), b"state@200")
        .unwrap();
    j.save_snapshot(&a, SequenceNr(300), WriterEpoch(1), b"state@300")
        .unwrap();
    gated.set_open(true);
    j.close().unwrap();

    // The save of 200, overtaken by that of 300 while it waited, was not
    // written: the snapshot file was synced twice (100, then 300).
    let snap_syncs = gated
        .synced
        .lock()
        .unwrap()
        .iter()
        .filter(|n| n.contains(".snap"))
        .count();
    assert_eq!(snap_syncs, 2, "{:?}", gated.synced.lock().unwrap());
    // Yet the removal that the save of 200 allowed found a snapshot in
    // place covering every event of the segments it removed.
    let removals = gated.removals.lock().unwrap().clone();
    assert!(removals.len() >= 4, "segments were removed: {removals:?}");
    for (max_event, snap) in &removals {
        assert!(
            snap >= max_event,
            "a segment with events up to {max_event} went with the snapshot at {snap} in place"
        );
    }
    let (j, _) = Journal::open_with_storage(Arc::new(mem), opts(4096, policy, 1)).unwrap();
    let r = j.recover(&a).unwrap();
    assert_eq!(r.snapshot.unwrap().data, b"state@300");
    assert!(r.events.is_empty());
    j.close().unwrap();
}
