//! Fuzz target: the segment reader on arbitrary bytes. The bytes become a
//! segment file (and are also decoded as index, checkpoint and snapshot
//! files); recovery, replay and verification must never panic, hang or
//! allocate from an unchecked length.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use shardline_journal::format::{
    self, Checkpoint, SegmentHeader, SegmentIndexFile, Snapshot, SEGMENT_HEADER_LEN_BYTES,
};
use shardline_journal::storage::{MemoryStorage, Storage};
use shardline_journal::{verify, JournalReader, Lsn, SequenceNr};

fuzz_target!(|data: &[u8]| {
    let _ = SegmentIndexFile::decode(data);
    let _ = Checkpoint::decode(data);
    let _ = Snapshot::decode(data);
    let first = SegmentHeader::decode(data).map_or(Lsn(1), |h| h.segment_id);
    let _ = format::scan_records(data, first, |r| {
        assert!(r.offset >= SEGMENT_HEADER_LEN_BYTES as u64);
        assert!(r.offset + r.len_bytes <= data.len() as u64);
    });

    // The same bytes as the only segment of a journal directory.
    let storage = MemoryStorage::new();
    let name = format::segment_name(first);
    if storage.write_file_durable(&name, data).is_err() {
        return;
    }
    let _ = verify::verify(&storage);
    if let Ok(reader) = JournalReader::open_with_storage(Arc::new(storage)) {
        for pid in reader.persistence_ids() {
            let _ = reader.replay(&pid, SequenceNr(1));
        }
    }
});
