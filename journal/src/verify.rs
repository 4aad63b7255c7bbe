//! Full scans for tools: verify every segment, list every record. These
//! read every byte of every segment (unlike replay, which uses the
//! indexes) and change nothing.

use std::collections::{BTreeSet, HashSet};
use std::io;
use std::path::Path;

use crate::error::CorruptionKind;
use crate::format::{
    decode_record, parse_numbered_name, scan_records, Decoded, RecordView, ScanStop, SegmentHeader,
    INDEX_SUFFIX, SEGMENT_HEADER_LEN_BYTES, SEGMENT_SUFFIX,
};
use crate::ids::{Lsn, WriterEpoch};
use crate::storage::{MmapStorage, Storage};

/// What verification found wrong in one segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SegmentProblem {
    /// A torn tail: invalid bytes with nothing valid after them. Usable:
    /// opening the journal cuts it.
    TornTail {
        /// Offset where the valid records end.
        offset: u64,
        /// Non-zero bytes after it, in bytes.
        bytes: u64,
        /// What the first invalid bytes were.
        kind: CorruptionKind,
    },
    /// Corruption before the tail: opening fails (strict mode).
    Corrupt {
        /// Offset of the corruption.
        offset: u64,
        /// What is wrong.
        kind: CorruptionKind,
    },
    /// The segment's writer epoch is below an earlier segment's.
    Stale {
        /// Its epoch.
        epoch: WriterEpoch,
        /// The higher epoch before it.
        newer_epoch: WriterEpoch,
    },
    /// The segment starts at an LSN covered by an earlier segment.
    Overlap {
        /// The lowest LSN it could start at.
        expected: Lsn,
    },
}

/// One segment's verification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentReport {
    /// The segment id (first LSN, from the file name).
    pub segment: Lsn,
    /// The file name.
    pub file: String,
    /// The file's length, in bytes.
    pub file_len_bytes: u64,
    /// The header's writer epoch, when the header is valid.
    pub writer_epoch: Option<WriterEpoch>,
    /// Valid records.
    pub records: u64,
    /// Bytes of valid records.
    pub record_bytes: u64,
    /// Whether an index file exists for it.
    pub has_index: bool,
    /// What is wrong, if anything.
    pub problem: Option<SegmentProblem>,
}

/// The result of [`verify`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// Every segment, in order.
    pub segments: Vec<SegmentReport>,
    /// Valid records in all segments.
    pub records: u64,
    /// Bytes of valid records in all segments.
    pub record_bytes: u64,
    /// Distinct persistence ids among the valid records.
    pub persistence_ids: u64,
}

impl VerifyReport {
    /// Whether the journal can be opened in strict mode (a torn tail is
    /// fine: it is cut on open).
    pub fn usable(&self) -> bool {
        self.segments
            .iter()
            .all(|s| matches!(s.problem, None | Some(SegmentProblem::TornTail { .. })))
    }
}

/// Segment (id, file name) pairs in order, and the ids that have an index.
type Listing = (Vec<(Lsn, String)>, BTreeSet<Lsn>);

fn segments(storage: &dyn Storage) -> io::Result<Listing> {
    let mut segs = Vec::new();
    let mut idx = BTreeSet::new();
    for n in storage.list()? {
        if let Some(id) = parse_numbered_name(&n, SEGMENT_SUFFIX) {
            segs.push((id, n));
        } else if let Some(id) = parse_numbered_name(&n, INDEX_SUFFIX) {
            idx.insert(id);
        }
    }
    segs.sort();
    Ok((segs, idx))
}

fn first_record_valid(storage: &dyn Storage, name: &str) -> bool {
    let Ok(f) = storage.open_segment(name, false) else {
        return false;
    };
    let v = f.view();
    SegmentHeader::decode(&v).is_ok()
        && matches!(
            decode_record(&v, SEGMENT_HEADER_LEN_BYTES as u64),
            Decoded::Record(_)
        )
}

/// Scans every segment of `storage` and classifies what it finds with the
/// same rules as recovery (FORMAT.md, "Recovery").
///
/// # Errors
/// I/O errors listing or opening files.
pub fn verify(storage: &dyn Storage) -> io::Result<VerifyReport> {
    let (segs, idx) = segments(storage)?;
    let mut report = VerifyReport::default();
    let mut pids: HashSet<Vec<u8>> = HashSet::new();
    let mut prev_epoch = WriterEpoch(0);
    let mut next_expected = Lsn(0);
    for (i, (id, name)) in segs.iter().enumerate() {
        let later_records = || {
            segs[i + 1..]
                .iter()
                .any(|(_, n)| first_record_valid(storage, n))
        };
        let file = storage.open_segment(name, false)?;
        let view = file.view();
        let mut sr = SegmentReport {
            segment: *id,
            file: name.clone(),
            file_len_bytes: view.len() as u64,
            writer_epoch: None,
            records: 0,
            record_bytes: 0,
            has_index: idx.contains(id),
            problem: None,
        };
        match SegmentHeader::decode(&view) {
            Err(e) => {
                let zero = view.iter().all(|&b| b == 0);
                sr.problem = Some(
                    if e == crate::format::HeaderError::Zeroed && zero && !later_records() {
                        SegmentProblem::TornTail {
                            offset: 0,
                            bytes: 0,
                            kind: CorruptionKind::Header(e),
                        }
                    } else {
                        SegmentProblem::Corrupt {
                            offset: 0,
                            kind: CorruptionKind::Header(e),
                        }
                    },
                );
            }
            Ok(h) if h.segment_id != *id => {
                sr.problem = Some(SegmentProblem::Corrupt {
                    offset: 16,
                    kind: CorruptionKind::NameMismatch {
                        found: h.segment_id,
                    },
                });
            }
            Ok(h) => {
                sr.writer_epoch = Some(h.writer_epoch);
                if h.writer_epoch < prev_epoch {
                    sr.problem = Some(SegmentProblem::Stale {
                        epoch: h.writer_epoch,
                        newer_epoch: prev_epoch,
                    });
                } else if *id < next_expected {
                    sr.problem = Some(SegmentProblem::Overlap {
                        expected: next_expected,
                    });
                } else {
                    prev_epoch = h.writer_epoch;
                    let s = scan_records(&view, *id, |r| {
                        if !pids.contains(r.persistence_id) {
                            pids.insert(r.persistence_id.to_vec());
                        }
                    });
                    sr.records = s.records;
                    sr.record_bytes = s.end_offset - SEGMENT_HEADER_LEN_BYTES as u64;
                    next_expected = Lsn(s.last_lsn.map_or(id.0, |l| l.0 + 1));
                    let (offset, kind, after, end) = match s.stop {
                        ScanStop::Clean => (0, None, false, 0),
                        ScanStop::Invalid {
                            offset,
                            reason,
                            valid_record_after,
                            last_nonzero_end,
                        } => (
                            offset,
                            Some(CorruptionKind::Record(reason)),
                            valid_record_after,
                            last_nonzero_end,
                        ),
                        ScanStop::LsnGap {
                            offset,
                            expected,
                            found,
                        } => (
                            offset,
                            Some(CorruptionKind::LsnGap { expected, found }),
                            true,
                            0,
                        ),
                    };
                    if let Some(kind) = kind {
                        let corrupt = after || (sr.has_index && later_records());
                        sr.problem = Some(if corrupt {
                            SegmentProblem::Corrupt { offset, kind }
                        } else {
                            SegmentProblem::TornTail {
                                offset,
                                bytes: end.saturating_sub(offset),
                                kind,
                            }
                        });
                    }
                }
            }
        }
        report.records += sr.records;
        report.record_bytes += sr.record_bytes;
        report.segments.push(sr);
    }
    report.persistence_ids = pids.len() as u64;
    Ok(report)
}

/// [`verify`] on a directory, read-only.
///
/// # Errors
/// `NotFound` when `dir` is not a directory; other I/O errors.
pub fn verify_dir(dir: impl AsRef<Path>) -> io::Result<VerifyReport> {
    verify(&MmapStorage::existing(dir)?)
}

/// Calls `f(segment id, record)` for every valid record of every segment,
/// in LSN order; each segment is read up to its first invalid record. A
/// full-scan iterator for tools; replay uses the indexes instead.
///
/// # Errors
/// I/O errors listing or opening files.
pub fn for_each_record(
    storage: &dyn Storage,
    mut f: impl FnMut(Lsn, &RecordView<'_>),
) -> io::Result<()> {
    let (segs, _) = segments(storage)?;
    for (id, name) in segs {
        let file = storage.open_segment(&name, false)?;
        let view = file.view();
        if SegmentHeader::decode(&view).is_ok() {
            scan_records(&view, id, |r| f(id, r));
        }
    }
    Ok(())
}
