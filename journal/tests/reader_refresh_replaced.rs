//! A refreshed view reads the directory afresh when it was replaced in ways
//! that keep the segment names or the checkpoint's range: emptied and
//! written again by a writer that removed its early segments, restored
//! from an earlier copy of itself, and a replacement noticed by an attempt
//! that then had to list the directory again.
mod common;

use std::path::Path;

use common::{answers, compare, opts, payload, pid, write};
use shardline_journal::{Durability, Journal, JournalReader, SequenceNr, WriterEpoch};

use std::sync::Arc;
use std::time::Duration;

fn clear(dir: &Path) {
    for e in std::fs::read_dir(dir).unwrap() {
        std::fs::remove_file(e.unwrap().path()).unwrap();
    }
}

fn ls(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// FN1: the directory emptied and written again by a writer that also
/// removed its early segments (every id snapshotted): every segment the
/// view read is gone, "covered" by the new journal's checkpoint, and no
/// segment the view read is still listed, so no header is compared.
#[test]
fn a_directory_emptied_and_rewritten_with_removals_is_read_afresh() {
    let dir = tempfile::tempdir().unwrap();
    write(dir.path(), 1, "old", 10, 20, 4096);
    let reader = JournalReader::open(dir.path()).unwrap();
    eprintln!("old: {:?}", ls(dir.path()));
    clear(dir.path());
    for round in 0..3 {
        let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::None, 1)).unwrap();
        for s in 1..=20u64 {
            for i in 0..10 {
                let id = format!("new|{i}");
                let seq = round * 20 + s;
                j.append(
                    &pid(&id),
                    SequenceNr(seq),
                    WriterEpoch(1),
                    &payload(&id, seq),
                )
                .unwrap();
            }
        }
        for i in 0..10 {
            j.save_snapshot(
                &pid(&format!("new|{i}")),
                SequenceNr(round * 20 + 20),
                WriterEpoch(1),
                b"s",
            )
            .unwrap();
        }
        for _ in 0..100 {
            j.maintain();
            std::thread::sleep(Duration::from_millis(1));
        }
        j.close().unwrap();
    }
    eprintln!("new: {:?}", ls(dir.path()));
    let mut ids: Vec<String> = (0..10).map(|i| format!("old|{i}")).collect();
    ids.extend((0..10).map(|i| format!("new|{i}")));
    compare(reader, dir.path(), &ids).unwrap();
}

/// FN3: the directory restored from a copy of itself taken while its
/// first segment held fewer records than the view later read through that
/// segment's index file; a writer then writes past the old length. The
/// segment has the same 64-byte header (same file), so nothing is noticed.
#[test]
fn a_directory_restored_from_an_earlier_copy_of_itself_is_read_afresh() {
    let dir = tempfile::tempdir().unwrap();
    let copy = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(1 << 20, Durability::None, 1)).unwrap();
    for s in 1..=15u64 {
        if s == 11 {
            // The copy (a backup) holds seqs 1..=10 of both ids.
            for n in ls(dir.path()) {
                std::fs::copy(dir.path().join(&n), copy.path().join(&n)).unwrap();
            }
        }
        for id in ["a|0", "a|1"] {
            j.append(&pid(id), SequenceNr(s), WriterEpoch(1), &payload(id, s))
                .unwrap();
        }
    }
    j.close().unwrap();
    // Reopened and closed: segment 1 sealed with its index file.
    Journal::open(dir.path(), opts(1 << 20, Durability::None, 1))
        .unwrap()
        .0
        .close()
        .unwrap();
    let reader = JournalReader::open(dir.path()).unwrap();
    eprintln!("before: {:?}", ls(dir.path()));
    clear(dir.path());
    for n in ls(copy.path()) {
        std::fs::copy(copy.path().join(&n), dir.path().join(&n)).unwrap();
    }
    write(dir.path(), 1, "c", 1, 20, 1 << 20);
    eprintln!("after: {:?}", ls(dir.path()));
    let ids: Vec<String> = ["a|0", "a|1", "c|0"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    compare(reader, dir.path(), &ids).unwrap();
}

mod flaky {
    use std::io;
    use std::sync::{Arc, Mutex};

    use shardline_journal::storage::{MappedFile, MemoryStorage, SegmentFile, Storage, TableFile};

    /// A storage whose next open of `fail` is NotFound once (a segment
    /// the writer removed between the view's listing and its open).
    #[derive(Debug, Clone)]
    pub struct Flaky {
        pub inner: MemoryStorage,
        pub fail: Arc<Mutex<Option<String>>>,
    }

    impl Storage for Flaky {
        fn list(&self) -> io::Result<Vec<String>> {
            self.inner.list()
        }
        fn create_segment(&self, name: &str, size_bytes: u64) -> io::Result<Box<dyn SegmentFile>> {
            self.inner.create_segment(name, size_bytes)
        }
        fn open_segment(&self, name: &str, writable: bool) -> io::Result<Box<dyn SegmentFile>> {
            let mut f = self.fail.lock().unwrap();
            if f.as_deref() == Some(name) {
                *f = None;
                return Err(io::Error::new(io::ErrorKind::NotFound, name.to_string()));
            }
            drop(f);
            self.inner.open_segment(name, writable)
        }
        fn truncate(&self, name: &str, len_bytes: u64) -> io::Result<()> {
            self.inner.truncate(name, len_bytes)
        }
        fn read_file(&self, name: &str) -> io::Result<Vec<u8>> {
            self.inner.read_file(name)
        }
        fn map_file(&self, name: &str) -> io::Result<MappedFile> {
            self.inner.map_file(name)
        }
        fn write_file_durable(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
            self.inner.write_file_durable(name, bytes)
        }
        fn write_file(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
            self.inner.write_file(name, bytes)
        }
        fn sync_file(&self, name: &str) -> io::Result<()> {
            self.inner.sync_file(name)
        }
        fn rename(&self, from: &str, to: &str) -> io::Result<()> {
            self.inner.rename(from, to)
        }
        fn exchange(&self, a: &str, b: &str) -> io::Result<()> {
            self.inner.exchange(a, b)
        }
        fn remove(&self, name: &str) -> io::Result<()> {
            self.inner.remove(name)
        }
        fn sync_dir(&self) -> io::Result<()> {
            self.inner.sync_dir()
        }
        fn open_table(&self, name: &str, writable: bool) -> io::Result<Box<dyn TableFile>> {
            self.inner.open_table(name, writable)
        }
    }
}

fn write_mem(
    mem: &shardline_journal::storage::MemoryStorage,
    prefix: &str,
    ids: usize,
    per_id: u64,
) {
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(mem.clone()), opts(4096, Durability::None, 1)).unwrap();
    for s in 1..=per_id {
        for i in 0..ids {
            let id = format!("{prefix}|{i}");
            j.append(&pid(&id), SequenceNr(s), WriterEpoch(1), &payload(&id, s))
                .unwrap();
        }
    }
    j.close().unwrap();
}

/// FN2: the directory emptied and written again (past its old length) is
/// noticed at the first segment; the attempt fails with NotFound at a
/// later segment (removed under the listing); the retry no longer has the
/// segments the failed attempt took out of `reuse`, checks none of them,
/// and keeps the old journal's state.
#[test]
fn a_replacement_noticed_before_a_retry_is_not_forgotten() {
    use shardline_journal::storage::{MemoryStorage, Storage};
    let mem = MemoryStorage::new();
    let fail = Arc::new(std::sync::Mutex::new(None));
    let flaky = flaky::Flaky {
        inner: mem.clone(),
        fail: fail.clone(),
    };
    write_mem(&mem, "old", 10, 20);
    let reader = JournalReader::open_with_storage(Arc::new(flaky.clone())).unwrap();
    for n in mem.list().unwrap() {
        mem.remove(&n).unwrap();
    }
    std::thread::sleep(Duration::from_millis(5));
    write_mem(&mem, "new", 10, 40);
    let segs: Vec<String> = mem
        .list()
        .unwrap()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .collect();
    eprintln!("new segments: {segs:?}");
    *fail.lock().unwrap() = Some(segs.last().unwrap().clone());
    let r = reader.refresh().unwrap();
    let fresh = JournalReader::open_with_storage(Arc::new(mem.clone())).unwrap();
    let mut ids: Vec<String> = (0..10).map(|i| format!("old|{i}")).collect();
    ids.extend((0..10).map(|i| format!("new|{i}")));
    assert_eq!(answers(&r, &ids).1, answers(&fresh, &ids).1, "ids known");
    assert_eq!(answers(&r, &ids), answers(&fresh, &ids));
}
