//! A read-only view brought up to date (`JournalReader::refresh`) answers
//! what a view opened afresh answers, whatever the writer did in between:
//! appends, snapshots (in the table and in files), deletions, segment
//! removals, a close and a reopen under a newer epoch; and it sees a live
//! writer's appends.

mod common;

use std::collections::BTreeMap;

use common::{opts, payload, pid};
use rand::{Rng, SeedableRng};
use shardline_journal::{Durability, Journal, JournalReader, SequenceNr, WriterEpoch};

/// What a view answers about `ids`: each id's highest sequence number, its
/// snapshot (sequence number, bytes) and the sequence numbers and payloads
/// of the events after it; and the ids it knows.
#[allow(clippy::type_complexity)]
fn answers(
    r: &JournalReader,
    ids: &[String],
) -> (
    Vec<(u64, Option<(u64, Vec<u8>)>, Vec<(u64, Vec<u8>)>)>,
    Vec<String>,
) {
    let per_id = ids
        .iter()
        .map(|id| {
            let p = pid(id);
            let rec = r.recover(&p).unwrap();
            (
                r.highest_sequence_nr(&p).0,
                rec.snapshot.map(|s| (s.sequence_nr.0, s.data)),
                rec.events
                    .into_iter()
                    .map(|e| (e.sequence_nr.0, e.payload))
                    .collect(),
            )
        })
        .collect();
    let known = r
        .persistence_ids()
        .into_iter()
        .map(|p| p.as_str().to_string())
        .collect();
    (per_id, known)
}

#[test]
fn a_refreshed_reader_answers_what_a_fresh_one_does() {
    for seed in 0..6u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<String> = (0..30).map(|i| format!("counter|{i}")).collect();
        let mut last: BTreeMap<String, u64> = BTreeMap::new();
        let mut epoch = 1;
        let (mut j, _) = Journal::open(dir.path(), opts(4096, Durability::None, epoch)).unwrap();
        let mut reader = JournalReader::open(dir.path()).unwrap();
        for phase in 0..12 {
            for _ in 0..rng.gen_range(20..200) {
                let id = &ids[rng.gen_range(0..ids.len())];
                let p = pid(id);
                let seq = last.entry(id.clone()).or_insert(0);
                match rng.gen_range(0..20) {
                    // A snapshot at the id's last event: small ones go to
                    // the table, large ones to a file of their own.
                    0..=2 if *seq > 0 => {
                        let size = if rng.gen_bool(0.3) { 600 } else { 40 };
                        let data = vec![(*seq % 251) as u8; size];
                        j.save_snapshot(&p, SequenceNr(*seq), WriterEpoch(epoch), &data)
                            .unwrap();
                    }
                    3 if *seq > 1 => {
                        let to = rng.gen_range(1..*seq);
                        j.delete_to(&p, SequenceNr(to), WriterEpoch(epoch)).unwrap();
                    }
                    _ => {
                        *seq += 1;
                        j.append(&p, SequenceNr(*seq), WriterEpoch(epoch), &payload(id, *seq))
                            .unwrap();
                    }
                }
            }
            if phase % 3 == 2 {
                // Every id covered by a snapshot: the sealed segments,
                // the ones written since the last refresh among them, are
                // removed before the view reads them, and their ids'
                // state is in the checkpoint alone.
                for (id, seq) in &last {
                    if *seq > 0 {
                        j.save_snapshot(&pid(id), SequenceNr(*seq), WriterEpoch(epoch), b"all")
                            .unwrap();
                    }
                }
            } else {
                // The writer's appends are in its mapped segments as soon
                // as they return: a refresh while it runs sees them all.
                reader = reader.refresh().unwrap();
                for (id, seq) in &last {
                    assert_eq!(
                        reader.highest_sequence_nr(&pid(id)).0,
                        *seq,
                        "seed {seed} phase {phase}: {id} seen live"
                    );
                }
            }
            // Closed, everything it did is on disk and no thread of it
            // changes the directory: both views must answer the same.
            j.close().unwrap();
            reader = reader.refresh().unwrap();
            let fresh = JournalReader::open(dir.path()).unwrap();
            assert_eq!(
                answers(&reader, &ids),
                answers(&fresh, &ids),
                "seed {seed} phase {phase}"
            );
            if phase % 4 == 3 {
                epoch += 1;
            }
            j = Journal::open(dir.path(), opts(4096, Durability::None, epoch))
                .unwrap()
                .0;
        }
        j.close().unwrap();
    }
}
