//! Recovery at the edges of a segment's creation: a zero-filled segment
//! shorter than a header is dropped as never written only when no later
//! segment may hold records (an error opening one is no answer), and the
//! temporary segment an open killed before putting it in place is ignored
//! by views and removed by the next open.
mod common;

use std::sync::Arc;

use common::{opts, payload, pid};
use shardline_journal::storage::{MemoryStorage, Storage};
use shardline_journal::{Durability, Journal, JournalReader, SequenceNr, WriterEpoch};

mod flaky {
    use std::io;
    use std::sync::{Arc, Mutex};

    use shardline_journal::storage::{MappedFile, MemoryStorage, SegmentFile, Storage, TableFile};

    /// A storage whose next open of `fail` fails once (EMFILE).
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
                return Err(io::Error::from_raw_os_error(24)); // EMFILE
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

fn write_mem(mem: &MemoryStorage) {
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(mem.clone()), opts(4096, Durability::None, 1)).unwrap();
    for s in 1..=20u64 {
        for i in 0..10 {
            let id = format!("a|{i}");
            j.append(&pid(&id), SequenceNr(s), WriterEpoch(1), &payload(&id, s))
                .unwrap();
        }
    }
    j.close().unwrap();
}

fn segs(mem: &MemoryStorage) -> Vec<String> {
    mem.list()
        .unwrap()
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .collect()
}

/// A sealed segment cut to 0 bytes (damage: its records were synced) before
/// the newest: a strict open refuses it. The same open, when the newest
/// segment cannot be opened by `later_has_records` (a transient error),
/// takes the short segment for one never written and removes it and the
/// newest: 30 acknowledged records gone, the open succeeds.
#[test]
fn a_short_zero_segment_is_kept_when_a_later_segment_cannot_be_opened() {
    let mem = MemoryStorage::new();
    write_mem(&mem);
    let s = segs(&mem);
    let (x, m) = (s[s.len() - 2].clone(), s[s.len() - 1].clone());
    mem.with_file_mut(&x, |v| v.clear()).unwrap();
    let control =
        Journal::open_with_storage(Arc::new(mem.clone()), opts(4096, Durability::None, 1))
            .map(|_| ())
            .map_err(|e| e.to_string());
    eprintln!("control (no open error): {control:?}");
    assert!(control.is_err());
    let fail = Arc::new(std::sync::Mutex::new(Some(m.clone())));
    let flaky = flaky::Flaky {
        inner: mem.clone(),
        fail,
    };
    let r = Journal::open_with_storage(Arc::new(flaky), opts(4096, Durability::None, 1));
    match r {
        Ok((j, report)) => {
            eprintln!(
                "opened: torn_tail {:?}, removed {:?}",
                report.torn_tail, report.removed_files
            );
            eprintln!("a|0 highest now {}", j.highest_sequence_nr(&pid("a|0")).0);
            drop(j);
            eprintln!("segments now: {:?}", segs(&mem));
            panic!("acknowledged records of {x} and {m} dropped on a transient open error");
        }
        Err(e) => eprintln!("refused: {e}"),
    }
}

/// A writer killed between creating its segment under the `.tmp` name and
/// the rename (with its header written, or not): views ignore the file,
/// the next writable open removes it, nothing read before is lost.
#[test]
fn the_temporary_segment_of_a_killed_open_is_ignored_then_removed() {
    for with_header in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _) = Journal::open(dir.path(), opts(1 << 20, Durability::None, 1)).unwrap();
        for s in 1..=10u64 {
            j.append(
                &pid("a|0"),
                SequenceNr(s),
                WriterEpoch(1),
                &payload("a|0", s),
            )
            .unwrap();
        }
        j.close().unwrap();
        // The open that was killed: it sealed the segment, then died.
        let (j, _) = Journal::open(dir.path(), opts(1 << 20, Durability::None, 2)).unwrap();
        drop(j);
        let next = shardline_journal::format::segment_name(shardline_journal::Lsn(11));
        let seg = dir.path().join(&next);
        let mut bytes = vec![0u8; 1 << 20];
        if with_header {
            bytes[..64].copy_from_slice(&std::fs::read(&seg).unwrap()[..64]);
        }
        std::fs::remove_file(&seg).unwrap();
        std::fs::write(dir.path().join(format!("{next}.tmp")), &bytes).unwrap();
        let v = JournalReader::open(dir.path()).unwrap();
        assert_eq!(v.highest_sequence_nr(&pid("a|0")).0, 10);
        let (mut j, report) =
            Journal::open(dir.path(), opts(1 << 20, Durability::None, 2)).unwrap();
        eprintln!(
            "with_header {with_header}: removed {:?}",
            report.removed_files
        );
        assert_eq!(j.highest_sequence_nr(&pid("a|0")).0, 10);
        j.append(&pid("a|0"), SequenceNr(11), WriterEpoch(2), b"x")
            .unwrap();
        j.close().unwrap();
        let v = v.refresh().unwrap();
        assert_eq!(v.highest_sequence_nr(&pid("a|0")).0, 11);
        assert!(!std::fs::read_dir(dir.path()).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".seg.tmp")));
    }
}
