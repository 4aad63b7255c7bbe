//! Appending, replaying, reopening, snapshots, deletion, durability and the
//! read-only reader, through the public API.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{opts, payload, pid};
use shardline_journal::storage::MemoryStorage;
use shardline_journal::{
    AppendError, Durability, Journal, JournalReader, Lsn, SequenceNr, SnapshotError, WriterEpoch,
};

#[test]
fn append_replay_reopen_across_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, rep) = Journal::open(dir.path(), opts(8192, Durability::Always, 1)).unwrap();
    assert_eq!(rep.records, 0);
    let mut lsns = Vec::new();
    for seq in 1..=200u64 {
        for p in ["a", "b"] {
            lsns.push(
                j.append(&pid(p), SequenceNr(seq), WriterEpoch(1), &payload(p, seq))
                    .unwrap(),
            );
        }
    }
    // LSNs are contiguous from 1.
    assert_eq!(lsns, (1..=400).map(Lsn).collect::<Vec<_>>());
    assert!(j.segment_count() > 3, "small segments must roll");
    j.wait_durable(Lsn(400)).unwrap();
    assert!(j.durable_lsn() >= Lsn(400));
    let got = j.replay(&pid("a"), SequenceNr(150)).unwrap();
    assert_eq!(got.len(), 51);
    assert_eq!(got[0].sequence_nr, SequenceNr(150));
    assert_eq!(got[0].payload, payload("a", 150));
    j.close().unwrap();

    let (mut j, rep) = Journal::open(dir.path(), opts(8192, Durability::Always, 1)).unwrap();
    assert_eq!(rep.records, 400);
    assert_eq!(rep.persistence_ids, 2);
    assert_eq!(rep.torn_tail, None);
    // Sealed segments carry index files: only the segment that was open
    // is scanned.
    assert!(rep.segments > 3);
    assert_eq!(rep.scanned_segments, 1);
    let all = j.replay(&pid("b"), SequenceNr(1)).unwrap();
    assert_eq!(all.len(), 200);
    for (i, r) in all.iter().enumerate() {
        assert_eq!(r.sequence_nr, SequenceNr(i as u64 + 1));
        assert_eq!(r.payload, payload("b", i as u64 + 1));
    }
    assert_eq!(j.highest_sequence_nr(&pid("a")), SequenceNr(200));
    assert!(matches!(
        j.append(&pid("a"), SequenceNr(200), WriterEpoch(1), b"x"),
        Err(AppendError::SequenceNotIncreasing { .. })
    ));
    assert_eq!(
        j.append(&pid("a"), SequenceNr(201), WriterEpoch(1), b"x")
            .unwrap(),
        Lsn(401)
    );
    j.close().unwrap();
}

#[test]
fn the_journal_lends_its_copy_of_a_persistence_id() {
    let storage = MemoryStorage::new();
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(storage.clone()), opts(4096, Durability::None, 0))
            .unwrap();
    assert_eq!(j.persistence_id("counter|1"), None);
    let p = pid("counter|1");
    j.append(&p, SequenceNr(1), WriterEpoch(0), b"x").unwrap();
    // The writer's id is the journal's: the same string, not a copy.
    let held = j.persistence_id("counter|1").unwrap();
    assert_eq!(held, p);
    assert!(std::ptr::eq(held.as_str(), p.as_str()));
    assert_eq!(j.persistence_id("counter|2"), None);
    j.close().unwrap();
    let (j, _) =
        Journal::open_with_storage(Arc::new(storage), opts(4096, Durability::None, 0)).unwrap();
    assert_eq!(j.persistence_id("counter|1"), Some(p));
}

#[test]
fn snapshot_then_replay_resumes_after_it() {
    let storage = MemoryStorage::new();
    let (mut j, _) =
        Journal::open_with_storage(Arc::new(storage.clone()), opts(4096, Durability::None, 0))
            .unwrap();
    let p = pid("counter|1");
    for seq in 1..=10 {
        j.append(&p, SequenceNr(seq), WriterEpoch(0), &payload("c", seq))
            .unwrap();
    }
    assert!(matches!(
        j.save_snapshot(&p, SequenceNr(11), WriterEpoch(0), b"s"),
        Err(SnapshotError::BadSequenceNr { .. })
    ));
    j.save_snapshot(&p, SequenceNr(6), WriterEpoch(0), b"state@6")
        .unwrap();
    assert!(matches!(
        j.save_snapshot(&p, SequenceNr(5), WriterEpoch(0), b"old"),
        Err(SnapshotError::BadSequenceNr { .. })
    ));
    let r = j.recover(&p).unwrap();
    assert_eq!(r.snapshot.as_ref().unwrap().data, b"state@6");
    assert_eq!(
        r.events.iter().map(|e| e.sequence_nr.0).collect::<Vec<_>>(),
        vec![7, 8, 9, 10]
    );
    j.close().unwrap();
    let (j, _) =
        Journal::open_with_storage(Arc::new(storage), opts(4096, Durability::None, 0)).unwrap();
    let r = j.recover(&p).unwrap();
    assert_eq!(r.snapshot.unwrap().sequence_nr, SequenceNr(6));
    assert_eq!(r.events.len(), 4);
    assert_eq!(j.load_snapshot(&pid("other")).unwrap(), None);
}

/// Waits (at most 10 s) until a snapshot file in `dir` holds sequence
/// number `seq`.
fn wait_for_snapshot_on_disk(dir: &std::path::Path, seq: u64) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let on_disk = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(Result::ok)
            .any(|e| {
                e.file_name().to_string_lossy().ends_with(".snap")
                    && std::fs::read(e.path())
                        .ok()
                        .and_then(|b| shardline_journal::Snapshot::decode(&b).ok())
                        .is_some_and(|s| s.sequence_nr == SequenceNr(seq))
            });
        if on_disk {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "snapshot {seq} never reached the disk"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Snapshot data too large for a slot of the snapshot table (a file of
/// its own).
fn big_state(seq: u64) -> Vec<u8> {
    let mut b = format!("state@{seq}").into_bytes();
    b.resize(400, b'.');
    b
}

#[test]
fn repeated_snapshots_on_disk_reopen_with_the_last_one() {
    // The second and later saves of a snapshot file exchange it with a
    // spare kept beside it; reopening finds the last save and removes the
    // spare (a temporary file).
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    let p = pid("counter|1");
    for seq in 1..=5 {
        j.append(&p, SequenceNr(seq), WriterEpoch(0), &payload("c", seq))
            .unwrap();
        j.save_snapshot(&p, SequenceNr(seq), WriterEpoch(0), &big_state(seq))
            .unwrap();
        // Each save reaches the disk before the next is made (a save that
        // a newer one overtakes in the journal's queue is not written).
        wait_for_snapshot_on_disk(dir.path(), seq);
    }
    assert_eq!(j.load_snapshot(&p).unwrap().unwrap().data, big_state(5));
    j.close().unwrap();
    let (j, report) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    let r = j.recover(&p).unwrap();
    let snap = r.snapshot.unwrap();
    assert_eq!(
        (snap.sequence_nr, snap.data.as_slice()),
        (SequenceNr(5), big_state(5).as_slice())
    );
    assert!(r.events.is_empty());
    assert!(
        report.removed_files.iter().any(|n| n.contains(".spare")),
        "the spare was removed at open: {:?}",
        report.removed_files
    );
}

#[test]
fn segments_covered_by_snapshots_go_once_their_last_blocking_id_is_covered() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    let (a, b) = (pid("a"), pid("b"));
    let mut last = Lsn(0);
    for seq in 1..=60 {
        j.append(&a, SequenceNr(seq), WriterEpoch(0), &[1u8; 100])
            .unwrap();
        last = j
            .append(&b, SequenceNr(seq), WriterEpoch(0), &[2u8; 100])
            .unwrap();
    }
    j.wait_durable(last).unwrap();
    let before = common::segment_files(dir.path()).len();
    assert!(before >= 4, "{before} segments");
    // `a` covered, `b` not: every sealed segment is kept (blocked by `b`),
    // however often `a` is saved again. (Removals are carried out by the
    // journal's meta thread: count the files after a close.)
    for _ in 0..3 {
        j.save_snapshot(&a, SequenceNr(60), WriterEpoch(0), b"a")
            .unwrap();
    }
    j.close().unwrap();
    assert_eq!(common::segment_files(dir.path()).len(), before);
    // Again in one session: `a` saved (its segments found blocked by `b`),
    // then `b`: the sealed segments are removed.
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    j.save_snapshot(&a, SequenceNr(60), WriterEpoch(0), b"a2")
        .unwrap();
    j.save_snapshot(&b, SequenceNr(60), WriterEpoch(0), b"b")
        .unwrap();
    j.close().unwrap();
    let after = common::segment_files(dir.path()).len();
    assert!(after < before, "{after} segments left of {before}");
    let (j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    assert_eq!(j.recover(&b).unwrap().snapshot.unwrap().data, b"b");
    assert_eq!(j.recover(&a).unwrap().snapshot.unwrap().data, b"a2");
}

#[test]
fn segments_go_once_all_their_ids_are_covered_in_any_order() {
    // Many ids per segment, covered in an order unrelated to the segment
    // index's: a segment goes only once its last id is covered, and then
    // it does (each check resumes where the one before stopped).
    let dir = tempfile::tempdir().unwrap();
    let ids: Vec<_> = (0..200).map(|i| pid(&format!("id-{i}"))).collect();
    let kept = 100;
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    let mut last = Lsn(0);
    for seq in 1..=2 {
        for p in &ids {
            last = j
                .append(p, SequenceNr(seq), WriterEpoch(0), &[3u8; 40])
                .unwrap();
        }
    }
    j.wait_durable(last).unwrap();
    let before = common::segment_files(dir.path()).len();
    assert!(before >= 6, "{before} segments");
    let odd = ids.iter().enumerate().filter(|(i, _)| i % 2 == 1);
    let even = ids.iter().enumerate().filter(|(i, _)| i % 2 == 0).rev();
    for (i, p) in odd.chain(even) {
        if i != kept {
            j.save_snapshot(p, SequenceNr(2), WriterEpoch(0), b"s")
                .unwrap();
        }
    }
    assert_eq!(j.replay(&ids[kept], SequenceNr(1)).unwrap().len(), 2);
    j.close().unwrap();
    let mid = common::segment_files(dir.path()).len();
    assert!(mid < before, "{mid} segments left of {before}");
    assert!(
        mid >= 2,
        "the segments of the uncovered id stay: {mid} left"
    );
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    let r = j.recover(&ids[kept]).unwrap();
    assert!(r.snapshot.is_none());
    assert_eq!(r.events.len(), 2, "the uncovered id keeps its events");
    for (i, p) in ids.iter().enumerate() {
        if i != kept {
            assert_eq!(j.recover(p).unwrap().snapshot.unwrap().data, b"s");
        }
    }
    // Every id covered (again, in this session): its segments go too.
    for p in ids.iter().rev() {
        j.save_snapshot(p, SequenceNr(2), WriterEpoch(0), b"t")
            .unwrap();
    }
    j.close().unwrap();
    let after = common::segment_files(dir.path()).len();
    assert!(after < mid, "{after} segments left of {mid}");
    let (j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    for p in &ids {
        assert_eq!(j.recover(p).unwrap().snapshot.unwrap().data, b"t");
    }
}

#[test]
fn delete_removes_fully_deleted_segments() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    let (a, b) = (pid("a"), pid("b"));
    for seq in 1..=100 {
        j.append(&a, SequenceNr(seq), WriterEpoch(0), &[7u8; 100])
            .unwrap();
    }
    let last = j
        .append(&b, SequenceNr(1), WriterEpoch(0), b"keep")
        .unwrap();
    j.wait_durable(last).unwrap();
    let before = common::segment_files(dir.path()).len();
    assert!(before >= 4);
    j.delete_to(&a, SequenceNr(90), WriterEpoch(0)).unwrap();
    assert_eq!(
        j.delete_to(&a, SequenceNr(50), WriterEpoch(0)).unwrap(),
        None
    );
    let got = j.replay(&a, SequenceNr(1)).unwrap();
    assert_eq!(got.first().unwrap().sequence_nr, SequenceNr(91));
    assert_eq!(got.len(), 10);
    j.close().unwrap();
    let after = common::segment_files(dir.path()).len();
    assert!(after < before, "{after} segments left of {before}");
    let (j, _) = Journal::open(dir.path(), opts(4096, Durability::Always, 0)).unwrap();
    assert_eq!(j.replay(&a, SequenceNr(1)).unwrap().len(), 10);
    assert_eq!(j.highest_sequence_nr(&a), SequenceNr(100));
    assert_eq!(j.replay(&b, SequenceNr(1)).unwrap()[0].payload, b"keep");
}

#[test]
fn delete_everything_keeps_sequence_and_epoch() {
    let storage = MemoryStorage::new();
    let open = |s: &MemoryStorage| {
        Journal::open_with_storage(Arc::new(s.clone()), opts(4096, Durability::None, 0))
            .unwrap()
            .0
    };
    let mut j = open(&storage);
    let a = pid("a");
    for seq in 1..=80 {
        j.append(&a, SequenceNr(seq), WriterEpoch(3), &[1u8; 120])
            .unwrap();
    }
    j.delete_to(&a, SequenceNr(u64::MAX), WriterEpoch(3))
        .unwrap();
    // Roll a few more segments with another id so the deleted ones go.
    for seq in 1..=80 {
        j.append(&pid("z"), SequenceNr(seq), WriterEpoch(0), &[2u8; 120])
            .unwrap();
    }
    j.close().unwrap();
    let mut j = open(&storage);
    assert!(j.replay(&a, SequenceNr(1)).unwrap().is_empty());
    assert_eq!(j.highest_sequence_nr(&a), SequenceNr(80));
    assert!(matches!(
        j.append(&a, SequenceNr(81), WriterEpoch(2), b"x"),
        Err(AppendError::Fenced { .. })
    ));
    j.append(&a, SequenceNr(81), WriterEpoch(3), b"x").unwrap();
}

#[test]
fn watcher_callbacks_and_polling() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(
        dir.path(),
        opts(1 << 20, Durability::Interval(Duration::from_millis(2)), 0),
    )
    .unwrap();
    let w = j.watcher();
    let hits = Arc::new(AtomicU64::new(0));
    let mut last = Lsn(0);
    for seq in 1..=50 {
        last = j
            .append(&pid("w"), SequenceNr(seq), WriterEpoch(0), b"e")
            .unwrap();
        let h = hits.clone();
        w.on_durable(last, move |r| {
            assert!(r.is_ok());
            h.fetch_add(1, Ordering::SeqCst);
        });
    }
    assert!(w
        .wait_durable_timeout(last, Duration::from_secs(10))
        .unwrap());
    assert!(w.is_durable(last));
    j.close().unwrap();
    assert_eq!(hits.load(Ordering::SeqCst), 50);
    // Under None, waiting asks for a flush.
    let (mut j, _) = Journal::open(dir.path(), opts(1 << 20, Durability::None, 0)).unwrap();
    let l = j
        .append(&pid("w"), SequenceNr(51), WriterEpoch(0), b"e")
        .unwrap();
    j.wait_durable(l).unwrap();
}

#[test]
fn reader_opens_a_live_writers_directory() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(8192, Durability::Always, 0)).unwrap();
    let mut last = Lsn(0);
    for seq in 1..=100 {
        last = j
            .append(
                &pid("s"),
                SequenceNr(seq),
                WriterEpoch(0),
                &payload("s", seq),
            )
            .unwrap();
    }
    j.wait_durable(last).unwrap();
    let r = JournalReader::open(dir.path()).unwrap();
    let got = r.replay(&pid("s"), SequenceNr(1)).unwrap();
    assert_eq!(got.len(), 100);
    assert_eq!(got[99].payload, payload("s", 100));
    assert_eq!(r.highest_sequence_nr(&pid("s")), SequenceNr(100));
    // The writer is not disturbed.
    j.append(&pid("s"), SequenceNr(101), WriterEpoch(0), b"more")
        .unwrap();
    j.close().unwrap();
    assert_eq!(r.persistence_ids(), vec![pid("s")]);
}

#[test]
fn reader_takes_bad_bytes_in_the_newest_segment_for_the_writers_record_in_progress() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(8192, Durability::Always, 0)).unwrap();
    let mut last = Lsn(0);
    for seq in 1..=100 {
        last = j
            .append(
                &pid("s"),
                SequenceNr(seq),
                WriterEpoch(0),
                &payload("s", seq),
            )
            .unwrap();
    }
    j.wait_durable(last).unwrap();
    let newest = common::segment_files(dir.path()).pop().unwrap();
    let in_newest: Vec<_> = common::records(dir.path())
        .into_iter()
        .filter(|r| r.0 == newest)
        .collect();
    assert!(in_newest.len() >= 3, "{in_newest:?}");
    // A record with valid records after it, as a reader racing the live
    // writer can see it: its CRC does not match (yet).
    let victim = in_newest[in_newest.len() - 2].clone();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.path().join(&newest))
        .unwrap();
    let mut crc = [0u8; 1];
    f.read_exact_at(&mut crc, victim.1 + 4).unwrap();
    f.write_all_at(&[crc[0] ^ 0xff], victim.1 + 4).unwrap();
    drop(f);
    let r = JournalReader::open(dir.path()).unwrap();
    let torn = r
        .report()
        .torn_tail
        .clone()
        .expect("reported as a torn tail");
    assert_eq!(torn.offset, victim.1);
    let got = r.replay(&pid("s"), SequenceNr(1)).unwrap();
    assert_eq!(got.len() as u64, victim.4 - 1);
    // The writer is not disturbed.
    j.append(&pid("s"), SequenceNr(101), WriterEpoch(0), b"more")
        .unwrap();
}
