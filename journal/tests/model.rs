//! Model-based test: random sequences of append, snapshot, delete and
//! close-and-reopen against an in-memory model; replay always equals the
//! model.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::pid;
use proptest::prelude::*;
use shardline_journal::storage::MemoryStorage;
use shardline_journal::{Durability, Journal, JournalOptions, SequenceNr, WriterEpoch};

#[derive(Debug, Clone)]
enum Op {
    Append { id: u8, len: usize },
    Snapshot { id: u8 },
    Delete { id: u8, back: u64 },
    Reopen { new_epoch: bool },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0u8..4, 0usize..300).prop_map(|(id, len)| Op::Append { id, len }),
        1 => (0u8..4).prop_map(|id| Op::Snapshot { id }),
        1 => (0u8..4, 0u64..5).prop_map(|(id, back)| Op::Delete { id, back }),
        1 => any::<bool>().prop_map(|new_epoch| Op::Reopen { new_epoch }),
    ]
}

#[derive(Default, Debug)]
struct Stream {
    events: Vec<(u64, Vec<u8>)>,
    deleted_to: u64,
    snapshot: Option<(u64, Vec<u8>)>,
}

impl Stream {
    fn last(&self) -> u64 {
        self.events.last().map_or(0, |e| e.0)
    }
}

fn options(durability: Durability, epoch: u64) -> JournalOptions {
    JournalOptions {
        segment_size_bytes: 4096,
        durability,
        writer_epoch: WriterEpoch(epoch),
        ..JournalOptions::default()
    }
}

fn check(j: &Journal, model: &BTreeMap<u8, Stream>) {
    for (id, s) in model {
        let p = pid(&format!("id-{id}"));
        let r = j.recover(&p).unwrap();
        let snap_seq = s.snapshot.as_ref().map_or(0, |x| x.0);
        assert_eq!(
            r.snapshot
                .as_ref()
                .map(|x| (x.sequence_nr.0, x.data.clone())),
            s.snapshot
        );
        let from = snap_seq.max(s.deleted_to);
        let want: Vec<(u64, Vec<u8>)> = s.events.iter().filter(|e| e.0 > from).cloned().collect();
        let got: Vec<(u64, Vec<u8>)> = r
            .events
            .iter()
            .filter(|e| e.sequence_nr.0 > from)
            .map(|e| (e.sequence_nr.0, e.payload.clone()))
            .collect();
        assert_eq!(got, want, "id {id}");
        // Nothing deleted is ever replayed.
        assert!(r.events.iter().all(|e| e.sequence_nr.0 > s.deleted_to));
        assert_eq!(j.highest_sequence_nr(&p), SequenceNr(s.last()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn replay_equals_model(ops in proptest::collection::vec(op(), 1..120), always in any::<bool>()) {
        let durability = if always { Durability::Always } else { Durability::None };
        let storage = MemoryStorage::new();
        let open = |epoch| Journal::open_with_storage(Arc::new(storage.clone()), options(durability, epoch)).unwrap().0;
        let mut epoch = 0;
        let mut j = open(epoch);
        let mut model: BTreeMap<u8, Stream> = BTreeMap::new();
        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::Append { id, len } => {
                    let s = model.entry(*id).or_default();
                    let seq = s.last() + 1;
                    let payload: Vec<u8> = (0..*len).map(|i| (i as u64 ^ seq ^ step as u64) as u8).collect();
                    j.append(&pid(&format!("id-{id}")), SequenceNr(seq), WriterEpoch(epoch), &payload).unwrap();
                    s.events.push((seq, payload));
                }
                Op::Snapshot { id } => {
                    let s = model.entry(*id).or_default();
                    let seq = s.last();
                    let data = format!("snap-{id}-{seq}").into_bytes();
                    j.save_snapshot(&pid(&format!("id-{id}")), SequenceNr(seq), WriterEpoch(epoch), &data).unwrap();
                    s.snapshot = Some((seq, data));
                }
                Op::Delete { id, back } => {
                    let s = model.entry(*id).or_default();
                    let to = s.last().saturating_sub(*back);
                    j.delete_to(&pid(&format!("id-{id}")), SequenceNr(to), WriterEpoch(epoch)).unwrap();
                    s.deleted_to = s.deleted_to.max(to);
                }
                Op::Reopen { new_epoch } => {
                    j.close().unwrap();
                    epoch += u64::from(*new_epoch);
                    j = open(epoch);
                }
            }
            check(&j, &model);
        }
        j.close().unwrap();
        let j = open(epoch);
        check(&j, &model);
    }
}
