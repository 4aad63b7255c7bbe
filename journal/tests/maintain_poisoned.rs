//! The journal's threads after a failure: `maintain()` (a data core calls it
//! every 5 ms) returns at once on a journal the sync thread poisoned,
//! instead of filling the sync thread's channel and waiting forever; and
//! a meta thread that panicked makes `close()` fail instead of leaving a
//! snapshot saved before it silently unwritten.
mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::{opts, pid};
use shardline_journal::storage::{
    FaultyStorage, MappedFile, MemoryStorage, SegmentFile, Storage, TableFile,
};
use shardline_journal::{Durability, Journal, SequenceNr, WriterEpoch};

#[derive(Clone, Debug)]
struct Gate {
    inner: FaultyStorage<MemoryStorage>,
    mem: MemoryStorage,
    open: Arc<(Mutex<bool>, Condvar)>,
}
impl Gate {
    fn set_open(&self, o: bool) {
        *self.open.0.lock().unwrap() = o;
        self.open.1.notify_all();
    }
    fn count(&self, ext: &str) -> usize {
        self.mem
            .list()
            .unwrap()
            .iter()
            .filter(|n| n.ends_with(ext))
            .count()
    }
}
impl Storage for Gate {
    fn list(&self) -> std::io::Result<Vec<String>> {
        self.inner.list()
    }
    fn create_segment(&self, n: &str, s: u64) -> std::io::Result<Box<dyn SegmentFile>> {
        self.inner.create_segment(n, s)
    }
    fn open_segment(&self, n: &str, w: bool) -> std::io::Result<Box<dyn SegmentFile>> {
        self.inner.open_segment(n, w)
    }
    fn truncate(&self, n: &str, l: u64) -> std::io::Result<()> {
        self.inner.truncate(n, l)
    }
    fn read_file(&self, n: &str) -> std::io::Result<Vec<u8>> {
        self.inner.read_file(n)
    }
    fn map_file(&self, n: &str) -> std::io::Result<MappedFile> {
        self.inner.map_file(n)
    }
    fn write_file_durable(&self, n: &str, b: &[u8]) -> std::io::Result<()> {
        if n.ends_with(".idx") {
            let (o, c) = &*self.open;
            let mut g = o.lock().unwrap();
            while !*g {
                g = c.wait(g).unwrap();
            }
        }
        self.inner.write_file_durable(n, b)
    }
    fn write_file(&self, n: &str, b: &[u8]) -> std::io::Result<()> {
        self.inner.write_file(n, b)
    }
    fn sync_file(&self, n: &str) -> std::io::Result<()> {
        self.inner.sync_file(n)
    }
    fn rename(&self, a: &str, b: &str) -> std::io::Result<()> {
        self.inner.rename(a, b)
    }
    fn exchange(&self, a: &str, b: &str) -> std::io::Result<()> {
        self.inner.exchange(a, b)
    }
    fn remove(&self, n: &str) -> std::io::Result<()> {
        self.inner.remove(n)
    }
    fn sync_dir(&self) -> std::io::Result<()> {
        self.inner.sync_dir()
    }
    fn open_table(&self, n: &str, w: bool) -> std::io::Result<Box<dyn TableFile>> {
        self.inner.open_table(n, w)
    }
}

#[test]
fn maintain_after_the_sync_thread_poisoned_does_not_hang() {
    const K: usize = 72;
    let mem = MemoryStorage::new();
    let faulty = FaultyStorage::new(mem.clone());
    let faults = faulty.faults();
    let gate = Gate {
        inner: faulty,
        mem: mem.clone(),
        open: Default::default(),
    };
    let (mut j, _) = Journal::open_with_storage(
        Arc::new(gate.clone()),
        opts(1536 * 1024, Durability::None, 1),
    )
    .unwrap();
    let e = WriterEpoch(1);
    let n: usize = (1..=K).map(|k| 256 * k).sum();
    let ids: Vec<_> = (0..n).map(|i| pid(&format!("d{i:06}"))).collect();
    // One event per id.
    for p in &ids {
        j.append(p, SequenceNr(1), e, b"").unwrap();
    }
    // Segment k gets 256*k deletion-only entries (all covered), closed by
    // big events of one filler id (deleted at the end): their counts end on
    // different calls, each queueing a removal.
    let f = pid("filler");
    let mut fseq = 0;
    let big = vec![7u8; 100 * 1024];
    let mut at = 0;
    for k in 1..=K {
        let before = j.segment_count();
        for p in &ids[at..at + 256 * k] {
            j.delete_to(p, SequenceNr(1), e).unwrap();
        }
        at += 256 * k;
        while j.segment_count() == before {
            fseq += 1;
            j.append(&f, SequenceNr(fseq), e, &big).unwrap();
        }
    }
    j.delete_to(&f, SequenceNr(fseq), e).unwrap();
    let sealed = j.segment_count() - 1;
    eprintln!("{sealed} sealed segments, {n} ids");
    // The index files are written and offered.
    gate.set_open(true);
    let deadline = Instant::now() + Duration::from_secs(120);
    while gate.count(".idx") < sealed {
        assert!(Instant::now() < deadline, "index files");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(200));
    // A flush fails: the sync thread poisons the journal.
    faults.fail_sync.store(true, Ordering::SeqCst);
    j.append(&pid("z"), SequenceNr(1), e, b"").unwrap(); // adopts every index
    j.request_flush();
    let w = j.watcher();
    while w.poisoned().is_none() {
        assert!(Instant::now() < deadline, "not poisoned");
        std::thread::sleep(Duration::from_millis(1));
    }
    eprintln!("poisoned: {:?}", w.poisoned());
    // A data core's timer keeps calling maintain().
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for i in 0..2000 {
            j.maintain();
            let _ = tx.send(i);
        }
        drop(j);
        let _ = tx.send(usize::MAX);
    });
    let mut last = 0;
    loop {
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(usize::MAX) => break,
            Ok(i) => last = i,
            Err(_) => panic!("maintain() hung after call #{last} (poisoned journal)"),
        }
    }
}

/// A storage whose index-file writes panic once the gate opens (a bug or
/// an allocation failure on the meta thread).
#[derive(Clone, Debug)]
struct PanicIdx {
    inner: MemoryStorage,
    open: Arc<(Mutex<bool>, Condvar)>,
}
impl Storage for PanicIdx {
    fn list(&self) -> std::io::Result<Vec<String>> {
        self.inner.list()
    }
    fn create_segment(&self, n: &str, s: u64) -> std::io::Result<Box<dyn SegmentFile>> {
        self.inner.create_segment(n, s)
    }
    fn open_segment(&self, n: &str, w: bool) -> std::io::Result<Box<dyn SegmentFile>> {
        self.inner.open_segment(n, w)
    }
    fn truncate(&self, n: &str, l: u64) -> std::io::Result<()> {
        self.inner.truncate(n, l)
    }
    fn read_file(&self, n: &str) -> std::io::Result<Vec<u8>> {
        self.inner.read_file(n)
    }
    fn write_file_durable(&self, n: &str, b: &[u8]) -> std::io::Result<()> {
        if n.ends_with(".idx") {
            let (o, c) = &*self.open;
            let mut g = o.lock().unwrap();
            while !*g {
                g = c.wait(g).unwrap();
            }
            panic!("meta thread dies writing {n}");
        }
        self.inner.write_file_durable(n, b)
    }
    fn write_file(&self, n: &str, b: &[u8]) -> std::io::Result<()> {
        self.inner.write_file(n, b)
    }
    fn sync_file(&self, n: &str) -> std::io::Result<()> {
        self.inner.sync_file(n)
    }
    fn rename(&self, a: &str, b: &str) -> std::io::Result<()> {
        self.inner.rename(a, b)
    }
    fn remove(&self, n: &str) -> std::io::Result<()> {
        self.inner.remove(n)
    }
    fn sync_dir(&self) -> std::io::Result<()> {
        self.inner.sync_dir()
    }
}

#[test]
fn a_snapshot_saved_before_close_is_durable_or_close_fails() {
    let mem = MemoryStorage::new();
    let s = PanicIdx {
        inner: mem.clone(),
        open: Default::default(),
    };
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(s.clone()), opts(4096, Durability::None, 1)).unwrap();
    let a = pid("a");
    // A roll: its index job holds up the meta thread.
    let mut seq = 0;
    while j.segment_count() < 2 {
        seq += 1;
        j.append(&a, SequenceNr(seq), WriterEpoch(1), &[1; 100])
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(50));
    // Queued behind it (no snapshot table in this storage: a file).
    j.save_snapshot(&a, SequenceNr(seq), WriterEpoch(1), b"state")
        .unwrap();
    *s.open.0.lock().unwrap() = true;
    s.open.1.notify_all();
    std::thread::sleep(Duration::from_millis(50));
    let closed = j.close();
    let on_disk = mem.list().unwrap().iter().any(|n| n.ends_with(".snap"));
    eprintln!("close: {closed:?}; snapshot file on disk: {on_disk}");
    assert!(
        on_disk || closed.is_err(),
        "close returned Ok, the snapshot saved before it is not on disk"
    );
}
