//! The snapshot table: small snapshots live in slot pairs of one file per
//! journal; a torn slot falls back to its pair's other slot only when every
//! event after it is still there.

mod common;

use std::sync::Arc;

use common::{opts, pid};
use shardline_journal::format::{SNAPSHOT_TABLE_NAME, TABLE_PAIR_BYTES, TABLE_SLOT_BYTES};
use shardline_journal::storage::{MemoryStorage, Storage};
use shardline_journal::{Durability, Journal, JournalReader, SequenceNr, WriterEpoch};

fn open(s: &MemoryStorage, seg: u64) -> Journal {
    Journal::open_with_storage(Arc::new(s.clone()), opts(seg, Durability::Always, 0))
        .unwrap()
        .0
}

fn append(j: &mut Journal, p: &str, seqs: std::ops::RangeInclusive<u64>) {
    let id = pid(p);
    let mut last = None;
    for seq in seqs {
        last = Some(
            j.append(&id, SequenceNr(seq), WriterEpoch(0), &[seq as u8; 100])
                .unwrap(),
        );
    }
    if let Some(l) = last {
        j.wait_durable(l).unwrap();
    }
}

/// Flips a byte inside slot `slot` of pair `pair`.
fn damage_slot(s: &MemoryStorage, pair: usize, slot: usize) {
    s.with_file_mut(SNAPSHOT_TABLE_NAME, |b| {
        b[pair * TABLE_PAIR_BYTES + slot * TABLE_SLOT_BYTES + 30] ^= 0xff;
    })
    .unwrap();
}

#[test]
fn small_snapshots_go_to_the_table_and_a_reopen_and_a_reader_find_the_newest() {
    let dir = tempfile::tempdir().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(1 << 20, Durability::Always, 0)).unwrap();
    for round in 1..=3u64 {
        for i in 0..50 {
            let p = pid(&format!("counter|{i}"));
            j.append(&p, SequenceNr(round), WriterEpoch(0), b"e")
                .unwrap();
            j.save_snapshot(
                &p,
                SequenceNr(round),
                WriterEpoch(0),
                format!("{i}@{round}").as_bytes(),
            )
            .unwrap();
        }
    }
    // Read back before the table is synced (from memory), and after.
    let p7 = pid("counter|7");
    assert_eq!(j.load_snapshot(&p7).unwrap().unwrap().data, b"7@3");
    j.close().unwrap();
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(names.iter().any(|n| n == SNAPSHOT_TABLE_NAME), "{names:?}");
    assert!(
        !names.iter().any(|n| n.ends_with(".snap")),
        "a small snapshot got a file: {names:?}"
    );
    // One pair per id.
    let len = std::fs::metadata(dir.path().join(SNAPSHOT_TABLE_NAME))
        .unwrap()
        .len();
    assert!(len <= 50 * TABLE_PAIR_BYTES as u64, "{len} bytes");
    let (j, _) = Journal::open(dir.path(), opts(1 << 20, Durability::Always, 0)).unwrap();
    for i in 0..50 {
        let r = j.recover(&pid(&format!("counter|{i}"))).unwrap();
        let s = r.snapshot.unwrap();
        assert_eq!(
            (s.sequence_nr, s.data),
            (SequenceNr(3), format!("{i}@3").into_bytes())
        );
        assert!(r.events.is_empty());
    }
    j.close().unwrap();
    let reader = JournalReader::open(dir.path()).unwrap();
    assert_eq!(reader.recover(&p7).unwrap().snapshot.unwrap().data, b"7@3");
}

#[test]
fn a_snapshot_that_outgrows_its_slot_gets_a_file_and_the_newest_source_wins() {
    let s = MemoryStorage::new();
    let mut j = open(&s, 1 << 20);
    let p = pid("doc|1");
    append(&mut j, "doc|1", 1..=3);
    j.save_snapshot(&p, SequenceNr(1), WriterEpoch(0), b"small@1")
        .unwrap();
    j.save_snapshot(&p, SequenceNr(2), WriterEpoch(0), &[b'x'; 600])
        .unwrap();
    assert_eq!(
        j.load_snapshot(&p).unwrap().unwrap().sequence_nr,
        SequenceNr(2)
    );
    j.close().unwrap();
    let mut j = open(&s, 1 << 20);
    let r = j.recover(&p).unwrap();
    assert_eq!(r.snapshot.unwrap().data, vec![b'x'; 600]);
    assert_eq!(r.events.len(), 1);
    // Small again: back to the table, newer than the file.
    j.save_snapshot(&p, SequenceNr(3), WriterEpoch(0), b"small@3")
        .unwrap();
    j.close().unwrap();
    let j = open(&s, 1 << 20);
    let r = j.recover(&p).unwrap();
    assert_eq!(r.snapshot.unwrap().data, b"small@3");
    assert!(r.events.is_empty());
}

#[test]
fn a_torn_slot_recovers_from_the_other_slot_and_every_event_after_it() {
    let s = MemoryStorage::new();
    let mut j = open(&s, 1 << 20);
    let p = pid("counter|a");
    append(&mut j, "counter|a", 1..=10);
    j.save_snapshot(&p, SequenceNr(5), WriterEpoch(0), b"a@5")
        .unwrap();
    j.close().unwrap();
    // Slot 0 holds 5 (synced at close); the next save goes to slot 1. At
    // 8 it covers no whole segment (the first holds 1..=10), so nothing
    // relied on it being durable: as when a crash tears the write before
    // its sync.
    let mut j = open(&s, 1 << 20);
    append(&mut j, "counter|a", 11..=15);
    j.save_snapshot(&p, SequenceNr(8), WriterEpoch(0), b"a@8")
        .unwrap();
    j.close().unwrap();
    // Torn: the snapshot at 5 and events 6..=15 remain.
    damage_slot(&s, 0, 1);
    let j = open(&s, 1 << 20);
    let r = j.recover(&p).unwrap();
    assert_eq!(r.snapshot.unwrap().data, b"a@5");
    let seqs: Vec<u64> = r.events.iter().map(|e| e.sequence_nr.0).collect();
    assert_eq!(seqs, (6..=15).collect::<Vec<_>>());
}

#[test]
fn a_damaged_newest_slot_whose_events_are_gone_is_reported_not_replayed_short() {
    let s = MemoryStorage::new();
    // Small segments: a snapshot lets the sealed ones it covers go.
    let mut j = open(&s, 4096);
    let p = pid("counter|a");
    append(&mut j, "counter|a", 1..=30);
    j.save_snapshot(&p, SequenceNr(30), WriterEpoch(0), b"a@30")
        .unwrap();
    j.close().unwrap();
    let mut j = open(&s, 4096);
    append(&mut j, "counter|a", 31..=60);
    j.close().unwrap();
    // The snapshot at 60 (slot 1) covers every sealed segment of 31..=60.
    let mut j = open(&s, 4096);
    j.save_snapshot(&p, SequenceNr(60), WriterEpoch(0), b"a@60")
        .unwrap();
    j.close().unwrap();
    let j = open(&s, 4096);
    let r = j.recover(&p).unwrap();
    assert_eq!(r.snapshot.unwrap().data, b"a@60");
    assert!(
        j.replay(&p, SequenceNr(31)).unwrap().is_empty(),
        "segments kept"
    );
    j.close().unwrap();
    // Damage the slot holding 60: the slot holding 30 is valid, but events
    // 31..=60 are gone.
    damage_slot(&s, 0, 1);
    let j = open(&s, 4096);
    let err = j.recover(&p).unwrap_err();
    assert!(err.to_string().contains(SNAPSHOT_TABLE_NAME), "{err}");
    // A reader of the directory refuses it the same way.
    let reader = JournalReader::open_with_storage(Arc::new(s.clone())).unwrap();
    assert!(reader.recover(&p).is_err());
}

#[test]
fn a_pair_with_no_readable_slot_makes_recovery_check_for_missing_events() {
    let s = MemoryStorage::new();
    let mut j = open(&s, 4096);
    let p = pid("counter|a");
    append(&mut j, "counter|a", 1..=60);
    j.close().unwrap();
    let mut j = open(&s, 4096);
    j.save_snapshot(&p, SequenceNr(60), WriterEpoch(0), b"a@60")
        .unwrap();
    j.close().unwrap();
    // Its only slot damaged: the id cannot be read from the table at all,
    // and its covered events are gone: refused, not recovered as empty.
    damage_slot(&s, 0, 0);
    let mut j = open(&s, 4096);
    assert!(j.recover(&p).is_err());
    // An id without a snapshot whose events are all there still recovers.
    append(&mut j, "counter|b", 1..=3);
    let r = j.recover(&pid("counter|b")).unwrap();
    assert_eq!(r.events.len(), 3);
}

#[test]
fn a_storage_without_tables_keeps_a_file_per_snapshot() {
    use shardline_journal::storage::FaultyStorage;
    let s = MemoryStorage::new();
    let plain = FaultyStorage::new(s.clone());
    plain
        .faults()
        .no_tables
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let (mut j, _) = Journal::open_with_storage(
        Arc::new(plain.clone()),
        opts(1 << 20, Durability::Always, 0),
    )
    .unwrap();
    let p = pid("counter|a");
    append(&mut j, "counter|a", 1..=2);
    j.save_snapshot(&p, SequenceNr(2), WriterEpoch(0), b"a@2")
        .unwrap();
    j.close().unwrap();
    let names = s.list().unwrap();
    assert!(names.iter().any(|n| n.ends_with(".snap")), "{names:?}");
    assert!(!names.iter().any(|n| n == SNAPSHOT_TABLE_NAME), "{names:?}");
    let (j, _) =
        Journal::open_with_storage(Arc::new(plain), opts(1 << 20, Durability::Always, 0)).unwrap();
    assert_eq!(j.recover(&p).unwrap().snapshot.unwrap().data, b"a@2");
}
