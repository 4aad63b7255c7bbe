//! Helpers shared by the journal's integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use shardline_journal::{
    format, verify, Durability, Journal, JournalOptions, JournalReader, Lsn, PersistenceId,
    SequenceNr, WriterEpoch,
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

// ------------------------------------------- a refreshed view against a fresh one

/// One id's answer: its highest sequence number, its snapshot (sequence
/// number, bytes) and its events after it (or the error).
pub type IdAnswer = (
    u64,
    Option<(u64, Vec<u8>)>,
    Result<Vec<(u64, Vec<u8>)>, String>,
);

/// Every id's answer, and the ids the view knows.
pub type Answers = (Vec<IdAnswer>, Vec<String>);

/// What view `r` answers about `ids` (see [`Answers`]).
pub fn answers(r: &JournalReader, ids: &[String]) -> Answers {
    let per_id = ids
        .iter()
        .map(|id| {
            let p = pid(id);
            let rec = r.recover(&p);
            let (snap, ev) = match rec {
                Ok(rec) => (
                    rec.snapshot.map(|s| (s.sequence_nr.0, s.data)),
                    Ok(rec
                        .events
                        .into_iter()
                        .map(|e| (e.sequence_nr.0, e.payload))
                        .collect()),
                ),
                Err(e) => (None, Err(e.to_string())),
            };
            (r.highest_sequence_nr(&p).0, snap, ev)
        })
        .collect();
    let known = r
        .persistence_ids()
        .into_iter()
        .map(|p| p.as_str().to_string())
        .collect();
    (per_id, known)
}

/// Writes `per_id` events of each of `ids` ids `{prefix}|{i}` into `dir`
/// (segments of `seg` bytes, durability none) with writer epoch `epoch`,
/// round-robin, then closes the journal.
pub fn write(dir: &Path, epoch: u64, prefix: &str, ids: usize, per_id: u64, seg: u64) {
    let (mut j, _) = Journal::open(dir, opts(seg, Durability::None, epoch)).unwrap();
    for s in 1..=per_id {
        for i in 0..ids {
            let id = format!("{prefix}|{i}");
            j.append(
                &pid(&id),
                SequenceNr(s),
                WriterEpoch(epoch),
                &payload(&id, s),
            )
            .unwrap();
        }
    }
    j.close().unwrap();
}

/// Refreshes `reader` and opens `dir` afresh: `Err` naming what differs
/// when their answers about `ids` do.
pub fn compare(reader: JournalReader, dir: &Path, ids: &[String]) -> Result<(), String> {
    let fresh = JournalReader::open(dir).map_err(|e| format!("fresh open failed: {e}"))?;
    let r = reader
        .refresh()
        .map_err(|e| format!("refresh failed where a fresh open succeeded: {e}"))?;
    let (a, b) = (answers(&r, ids), answers(&fresh, ids));
    if a != b {
        let mut diff = String::new();
        for (i, id) in ids.iter().enumerate() {
            if a.0[i] != b.0[i] {
                let short = |x: &IdAnswer| {
                    (
                        x.0,
                        x.1.as_ref().map(|s| s.0),
                        x.2.as_ref()
                            .map(|v| v.iter().map(|e| e.0).collect::<Vec<_>>())
                            .map_err(Clone::clone),
                    )
                };
                diff += &format!(
                    "\n  {id}: refreshed {:?} / fresh {:?}",
                    short(&a.0[i]),
                    short(&b.0[i])
                );
            }
        }
        if a.1 != b.1 {
            diff += &format!("\n  ids: refreshed {} / fresh {}", a.1.len(), b.1.len());
        }
        return Err(format!("answers differ:{diff}"));
    }
    Ok(())
}
