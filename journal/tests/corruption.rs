//! One named test per corruption case (FORMAT.md, "Recovery"), through the
//! public API on real files.

mod common;

use std::path::Path;

use common::{fill, modify, opts, payload, pid, records, segment_files};
use shardline_journal::format::{HeaderError, RecordError, SegmentHeader};
use shardline_journal::verify::{verify_dir, SegmentProblem};
use shardline_journal::{
    CorruptionKind, Durability, Journal, JournalOptions, Lsn, OpenError, RecoveryError,
    RecoveryMode, ReplayError, SequenceNr, WriterEpoch,
};

const SEG: u64 = 8192;

fn reopen(dir: &Path) -> Result<Journal, OpenError> {
    Journal::open(dir, opts(SEG, Durability::Always, 1)).map(|(j, _)| j)
}

fn expect_corrupt(r: Result<Journal, OpenError>) -> (Lsn, u64, CorruptionKind) {
    match r {
        Err(OpenError::Recovery(RecoveryError::Corrupt {
            segment,
            offset,
            kind,
            file,
        })) => {
            assert!(file.ends_with(".seg"));
            (segment, offset, kind)
        }
        Err(e) => panic!("expected corruption, got {e}"),
        Ok(_) => panic!("expected corruption, journal opened"),
    }
}

/// Fills a journal with several segments and closes it.
fn journal_with_segments(dir: &Path, n: u64) {
    fill(dir, SEG, n).close().unwrap();
    assert!(segment_files(dir).len() >= 3);
}

#[test]
fn torn_tail_is_cut_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    journal_with_segments(dir.path(), 120);
    let recs = records(dir.path());
    let (file, off, len, p, seq) = recs.last().unwrap().clone();
    // A partial last record: its last 5 bytes never reached the disk.
    modify(&dir.path().join(&file), |b| {
        for x in &mut b[(off + len - 5) as usize..(off + len) as usize] {
            *x = 0;
        }
    });
    let (j, rep) = Journal::open(dir.path(), opts(SEG, Durability::Always, 1)).unwrap();
    let torn = rep.torn_tail.expect("torn tail reported");
    assert_eq!(torn.file, file);
    assert_eq!(torn.offset, off);
    assert!(torn.bytes_cut > 0 && torn.bytes_cut <= len);
    assert_eq!(j.highest_sequence_nr(&pid(&p)), SequenceNr(seq - 1));
    let got = j.replay(&pid(&p), SequenceNr(1)).unwrap();
    assert_eq!(got.last().unwrap().sequence_nr, SequenceNr(seq - 1));
    drop(j);
    assert_eq!(records(dir.path()).len(), recs.len() - 1);
}

#[test]
fn zeroed_tail_page_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), 1 << 20, 100).close().unwrap();
    let recs = records(dir.path());
    let (file, off, len, _, _) = recs.last().unwrap().clone();
    let end = off + len;
    let page_start = (end - 1) / 4096 * 4096;
    assert!(page_start > 64, "records must span more than one page");
    modify(&dir.path().join(&file), |b| {
        for x in &mut b[page_start as usize..(page_start + 4096) as usize] {
            *x = 0;
        }
    });
    let survivors: Vec<_> = recs
        .iter()
        .filter(|r| r.1 + r.2 <= page_start)
        .cloned()
        .collect();
    let (j, rep) = Journal::open(dir.path(), opts(1 << 20, Durability::Always, 1)).unwrap();
    assert!(rep.torn_tail.is_some());
    assert_eq!(rep.records, survivors.len() as u64);
    for p in ["p0", "p1", "p2"] {
        let want: Vec<u64> = survivors.iter().filter(|r| r.3 == p).map(|r| r.4).collect();
        let got: Vec<u64> = j
            .replay(&pid(p), SequenceNr(1))
            .unwrap()
            .iter()
            .map(|r| r.sequence_nr.0)
            .collect();
        assert_eq!(got, want);
    }
}

#[test]
fn bit_flip_in_sealed_segment_payload_is_named() {
    let dir = tempfile::tempdir().unwrap();
    journal_with_segments(dir.path(), 120);
    let recs = records(dir.path());
    let first_seg = segment_files(dir.path())[0].clone();
    // A record with a payload in the first (sealed, indexed) segment.
    let (file, off, len, p, seq) = recs
        .iter()
        .find(|r| r.0 == first_seg && r.2 > 60 && r.1 > 64)
        .unwrap()
        .clone();
    modify(&dir.path().join(&file), |b| {
        b[(off + len - 1) as usize] ^= 0x04
    });

    // Open does not scan sealed segments; replay through the index finds it.
    let j = reopen(dir.path()).unwrap();
    match j.replay(&pid(&p), SequenceNr(1)) {
        Err(ReplayError::Corrupt {
            segment,
            offset,
            kind,
            ..
        }) => {
            assert_eq!(segment, Lsn(1));
            assert_eq!(offset, off);
            assert_eq!(kind, CorruptionKind::Record(RecordError::BadChecksum));
        }
        other => panic!("expected corruption, got {other:?}"),
    }
    drop(j);
    // Verification and a verifying open name segment and offset.
    let v = verify_dir(dir.path()).unwrap();
    assert!(!v.usable());
    assert_eq!(
        v.segments[0].problem,
        Some(SegmentProblem::Corrupt {
            offset: off,
            kind: CorruptionKind::Record(RecordError::BadChecksum)
        })
    );
    let strict = JournalOptions {
        verify_all_on_open: true,
        ..opts(SEG, Durability::Always, 1)
    };
    let (segment, offset, _) = expect_corrupt(Journal::open(dir.path(), strict).map(|x| x.0));
    assert_eq!((segment, offset), (Lsn(1), off));
    // Repair mode cuts there, explicitly.
    let repair = JournalOptions {
        recovery: RecoveryMode::Repair,
        ..opts(SEG, Durability::Always, 1)
    };
    let (j, rep) = Journal::open(dir.path(), repair).unwrap();
    assert_eq!(rep.repairs.len(), 1);
    assert_eq!(rep.repairs[0].offset, off);
    let got = j.replay(&pid(&p), SequenceNr(1)).unwrap();
    assert_eq!(got.last().map_or(0, |r| r.sequence_nr.0), seq - 1);
}

#[test]
fn bit_flip_in_record_header_fails_open() {
    let dir = tempfile::tempdir().unwrap();
    fill(dir.path(), 1 << 20, 50).close().unwrap();
    let recs = records(dir.path());
    let (file, off, _, _, _) = recs[20].clone();
    // Flip a bit of the sequence number field (header bytes 16..24).
    modify(&dir.path().join(&file), |b| b[off as usize + 17] ^= 0x01);
    let (segment, offset, kind) = expect_corrupt(reopen(dir.path()));
    assert_eq!(segment, Lsn(1));
    assert_eq!(offset, off);
    assert_eq!(kind, CorruptionKind::Record(RecordError::BadChecksum));
    let v = verify_dir(dir.path()).unwrap();
    assert!(!v.usable());
}

#[test]
fn truncated_sealed_file_fails_open() {
    let dir = tempfile::tempdir().unwrap();
    journal_with_segments(dir.path(), 120);
    let first = segment_files(dir.path())[0].clone();
    let path = dir.path().join(&first);
    let len = std::fs::metadata(&path).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(len / 2).unwrap();
    let (segment, offset, kind) = expect_corrupt(reopen(dir.path()));
    assert_eq!(segment, Lsn(1));
    assert_eq!(offset, len / 2);
    assert!(matches!(kind, CorruptionKind::Truncated { .. }));
}

#[test]
fn file_shorter_than_header_fails_open() {
    let dir = tempfile::tempdir().unwrap();
    journal_with_segments(dir.path(), 120);
    let recs = records(dir.path());
    let next = recs.len() as u64 + 1;
    let name = shardline_journal::format::segment_name(Lsn(next));
    std::fs::write(dir.path().join(&name), [1u8; 10]).unwrap();
    let (segment, offset, kind) = expect_corrupt(reopen(dir.path()));
    assert_eq!(segment, Lsn(next));
    assert_eq!(offset, 0);
    assert_eq!(
        kind,
        CorruptionKind::Header(HeaderError::TooShort { len_bytes: 10 })
    );
}

#[test]
fn wrong_magic_fails_open() {
    let dir = tempfile::tempdir().unwrap();
    journal_with_segments(dir.path(), 120);
    let first = segment_files(dir.path())[0].clone();
    modify(&dir.path().join(&first), |b| {
        b[0..8].copy_from_slice(b"NOTAJRNL")
    });
    let (segment, offset, kind) = expect_corrupt(reopen(dir.path()));
    assert_eq!((segment, offset), (Lsn(1), 0));
    assert_eq!(kind, CorruptionKind::Header(HeaderError::BadMagic));
}

#[test]
fn wrong_format_version_fails_open() {
    let dir = tempfile::tempdir().unwrap();
    journal_with_segments(dir.path(), 120);
    let first = segment_files(dir.path())[0].clone();
    // A newer build's segment: version 9, its header checksum holding.
    modify(&dir.path().join(&first), |b| {
        b[8..12].copy_from_slice(&9u32.to_le_bytes());
        let crc = crc32c::crc32c(&b[..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
    });
    match reopen(dir.path()) {
        Err(OpenError::Recovery(RecoveryError::UnsupportedVersion { file, version })) => {
            assert_eq!(file, first);
            assert_eq!(version, 9);
        }
        Err(e) => panic!("unexpected {e}"),
        Ok(_) => panic!("opened a journal of an unknown version"),
    }
}

#[test]
fn a_flipped_version_field_is_damage_not_a_newer_format() {
    let dir = tempfile::tempdir().unwrap();
    journal_with_segments(dir.path(), 120);
    let first = segment_files(dir.path())[0].clone();
    modify(&dir.path().join(&first), |b| b[9] ^= 1);
    match reopen(dir.path()) {
        Err(OpenError::Recovery(RecoveryError::Corrupt {
            file, offset, kind, ..
        })) => {
            assert_eq!((file, offset), (first, 0));
            assert!(kind.to_string().contains("checksum"), "{kind}");
        }
        Err(e) => panic!("unexpected {e}"),
        Ok(_) => panic!("opened a journal with a damaged header"),
    }
}

#[test]
fn stale_segment_from_older_writer_epoch_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Epoch 1 writes, then epoch 2 takes over and writes.
    fill(dir.path(), SEG, 30).close().unwrap();
    let (mut j, _) = Journal::open(dir.path(), opts(SEG, Durability::Always, 2)).unwrap();
    let p = pid("p0");
    let seq = j.highest_sequence_nr(&p).0 + 1;
    let l = j
        .append(&p, SequenceNr(seq), WriterEpoch(2), &payload("p0", seq))
        .unwrap();
    j.wait_durable(l).unwrap();
    j.close().unwrap();
    // A zombie writer of epoch 1 leaves a segment after epoch 2's.
    let next = l.0 + 1;
    let name = shardline_journal::format::segment_name(Lsn(next));
    let mut bytes = vec![0u8; SEG as usize];
    let h = SegmentHeader {
        segment_id: Lsn(next),
        writer_epoch: WriterEpoch(1),
        segment_size_bytes: SEG,
        created_ms: 0,
    };
    bytes[..64].copy_from_slice(&h.encode());
    std::fs::write(dir.path().join(&name), &bytes).unwrap();
    match Journal::open(dir.path(), opts(SEG, Durability::Always, 2)) {
        Err(OpenError::Recovery(RecoveryError::StaleSegment {
            segment,
            epoch,
            newer_epoch,
            ..
        })) => {
            assert_eq!(segment, Lsn(next));
            assert_eq!(epoch, WriterEpoch(1));
            assert_eq!(newer_epoch, WriterEpoch(2));
        }
        Err(e) => panic!("unexpected {e}"),
        Ok(_) => panic!("opened with a stale segment"),
    }
    // The zombie itself cannot open the directory for writing.
    assert!(matches!(
        Journal::open(dir.path(), opts(SEG, Durability::Always, 1)),
        Err(OpenError::Fenced { .. }) | Err(OpenError::Recovery(_))
    ));
    std::fs::remove_file(dir.path().join(&name)).unwrap();
    assert!(matches!(
        Journal::open(dir.path(), opts(SEG, Durability::Always, 1)),
        Err(OpenError::Fenced {
            epoch: WriterEpoch(1),
            highest: WriterEpoch(2)
        })
    ));
    // Repair mode removes a stale segment.
    std::fs::write(dir.path().join(&name), &bytes).unwrap();
    let repair = JournalOptions {
        recovery: RecoveryMode::Repair,
        ..opts(SEG, Durability::Always, 2)
    };
    let (j, rep) = Journal::open(dir.path(), repair).unwrap();
    assert_eq!(rep.repairs.len(), 1);
    assert_eq!(j.highest_sequence_nr(&p), SequenceNr(seq));
}

#[test]
fn an_index_file_whose_events_disagree_with_its_highest_sequence_nr_is_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    journal_with_segments(dir.path(), 120);
    let truth = {
        let (j, rep) = Journal::open(dir.path(), opts(SEG, Durability::Always, 1)).unwrap();
        assert_eq!(
            rep.scanned_segments, 1,
            "only the last segment has no index file"
        );
        let t: Vec<u64> = (0..3)
            .map(|i| j.highest_sequence_nr(&pid(&format!("p{i}"))).0)
            .collect();
        j.close().unwrap();
        t
    };
    let first = segment_files(dir.path())[0].clone();
    let idx = dir.path().join(first.replace(".seg", ".idx"));
    let mut f = shardline_journal::format::SegmentIndexFile::decode(&std::fs::read(&idx).unwrap())
        .expect("a valid index file");
    // Checksummed and well formed, but its highest event is not its last.
    f.entries[0].1.last_event_seq = SequenceNr(f.entries[0].1.last_event_seq.0 + 1000);
    std::fs::write(&idx, f.encode()).unwrap();
    let (j, rep) = Journal::open(dir.path(), opts(SEG, Durability::Always, 1)).unwrap();
    assert_eq!(
        rep.scanned_segments, 2,
        "the segment with the inconsistent index is scanned"
    );
    let after: Vec<u64> = (0..3)
        .map(|i| j.highest_sequence_nr(&pid(&format!("p{i}"))).0)
        .collect();
    assert_eq!(after, truth);
}
