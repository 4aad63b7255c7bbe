//! Helpers shared by the journal's integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use shardline_journal::{
    format, verify, Durability, Journal, JournalOptions, Lsn, PersistenceId, SequenceNr,
    WriterEpoch,
};

pub fn pid(s: &str) -> PersistenceId {
    PersistenceId::new(s).unwrap()
}

/// Deterministic payload of `pid`'s event `seq`.
pub fn payload(pid: &str, seq: u64) -> Vec<u8> {
    let unit = format!("{pid}:{seq};");
    unit.as_bytes()
        .iter()
        .copied()
        .cycle()
        .take((seq as usize * 37) % 300)
        .collect()
}

pub fn opts(segment_size_bytes: u64, durability: Durability, epoch: u64) -> JournalOptions {
    JournalOptions {
        segment_size_bytes,
        durability,
        writer_epoch: WriterEpoch(epoch),
        ..JournalOptions::default()
    }
}

/// Opens `dir` and appends `n` events spread over three ids, returns the
/// journal after waiting for durability.
pub fn fill(dir: &Path, segment_size_bytes: u64, n: u64) -> Journal {
    let (mut j, _) = Journal::open(
        dir,
        opts(
            segment_size_bytes,
            Durability::Interval(Duration::from_millis(1)),
            1,
        ),
    )
    .unwrap();
    let mut last = Lsn(0);
    for i in 0..n {
        let p = format!("p{}", i % 3);
        let seq = j.highest_sequence_nr(&pid(&p)).0 + 1;
        last = j
            .append(&pid(&p), SequenceNr(seq), WriterEpoch(1), &payload(&p, seq))
            .unwrap();
    }
    if n > 0 {
        j.wait_durable(last).unwrap();
    }
    j
}

/// (segment file name, offset, length, pid, seq) of every record.
pub fn records(dir: &Path) -> Vec<(String, u64, u64, String, u64)> {
    let storage = shardline_journal::storage::MmapStorage::existing(dir).unwrap();
    let mut out = Vec::new();
    verify::for_each_record(&storage, |seg, r| {
        out.push((
            format::segment_name(seg),
            r.offset,
            r.len_bytes,
            String::from_utf8(r.persistence_id.to_vec()).unwrap(),
            r.sequence_nr.0,
        ))
    })
    .unwrap();
    out
}

pub fn segment_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".seg"))
        .collect();
    v.sort();
    v
}

pub fn modify(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    let mut b = std::fs::read(path).unwrap();
    f(&mut b);
    std::fs::write(path, b).unwrap();
}
