//! Error types, one per operation family.

use std::io;

use crate::format::{FileDecodeError, HeaderError, RecordError};
use crate::ids::{Lsn, PersistenceId, SequenceNr, WriterEpoch};

/// What is wrong at a place in a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CorruptionKind {
    /// The segment header is invalid.
    #[error("bad segment header: {0}")]
    Header(HeaderError),
    /// A record is invalid.
    #[error("bad record: {0}")]
    Record(RecordError),
    /// A record's LSN does not follow its predecessor's.
    #[error("LSN {found} where {expected} was expected")]
    LsnGap {
        /// The expected LSN.
        expected: Lsn,
        /// The LSN found.
        found: Lsn,
    },
    /// The header's segment id does not match the file name.
    #[error("header names segment {found}")]
    NameMismatch {
        /// The segment id in the header.
        found: Lsn,
    },
    /// The file is shorter than its index says.
    #[error("file is {len_bytes} bytes but its index says records end at {end_offset}")]
    Truncated {
        /// The file's length, in bytes.
        len_bytes: u64,
        /// Where the index says the records end.
        end_offset: u64,
    },
    /// An index entry does not point at the record it names.
    #[error("index entry points at a record that does not match it")]
    IndexMismatch,
    /// The segment's index file, read in place, no longer holds whole
    /// entries (it changed on disk after it was checked); the offset is
    /// in the index file.
    #[error("its index file is damaged: {0}")]
    IndexFile(FileDecodeError),
}

/// Why recovery refused a journal directory.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecoveryError {
    /// Corruption before the tail: invalid bytes with valid records after
    /// them. Open in [`crate::RecoveryMode::Repair`] to truncate there.
    #[error("segment {segment} ({file}) is corrupt at byte offset {offset}: {kind}")]
    Corrupt {
        /// The segment id.
        segment: Lsn,
        /// The segment's file name.
        file: String,
        /// Byte offset of the corruption in the file.
        offset: u64,
        /// What is wrong.
        kind: CorruptionKind,
    },
    /// A segment whose header epoch is lower than an earlier segment's: it
    /// was written by a writer that had already been superseded.
    #[error("segment {segment} ({file}) is stale: writer epoch {epoch} is below epoch {newer_epoch} of an earlier segment")]
    StaleSegment {
        /// The segment id.
        segment: Lsn,
        /// The segment's file name.
        file: String,
        /// Its header's writer epoch.
        epoch: WriterEpoch,
        /// The higher epoch seen before it.
        newer_epoch: WriterEpoch,
    },
    /// A segment starts at an LSN already covered by earlier segments.
    #[error("segment {segment} ({file}) overlaps earlier segments (next LSN is {expected})")]
    Overlap {
        /// The segment id.
        segment: Lsn,
        /// The segment's file name.
        file: String,
        /// The lowest LSN a next segment may start at.
        expected: Lsn,
    },
    /// A file of a format version this build does not read. Never repaired.
    #[error("{file} has format version {version}; this build reads version 1")]
    UnsupportedVersion {
        /// The file name.
        file: String,
        /// The version found.
        version: u32,
    },
    /// The state checkpoint file is damaged.
    #[error("{file} is damaged: {reason}")]
    BadFile {
        /// The file name.
        file: String,
        /// What is wrong.
        reason: FileDecodeError,
    },
    /// An I/O error while reading or repairing the directory.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Errors from opening a journal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// Recovery refused the directory.
    #[error(transparent)]
    Recovery(#[from] RecoveryError),
    /// The directory holds a segment of a newer writer epoch.
    #[error("writer epoch {epoch} is fenced: the directory holds segments of epoch {highest}")]
    Fenced {
        /// The epoch this writer opened with.
        epoch: WriterEpoch,
        /// The highest segment epoch in the directory.
        highest: WriterEpoch,
    },
    /// The options are inconsistent.
    #[error("invalid journal options: {0}")]
    InvalidOptions(String),
    /// An I/O error (for example `ENOSPC` when preallocating the first
    /// segment).
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Errors from appending an event or a deletion marker.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppendError {
    /// An earlier write or flush failed; the journal refuses every append
    /// until it is reopened (which recovers what is durable).
    #[error("journal is poisoned: {reason}")]
    Poisoned {
        /// The failed operation and its OS error.
        reason: String,
    },
    /// The epoch is below the highest recorded for the persistence id.
    #[error("persistence id {persistence_id}: writer epoch {epoch} is fenced by epoch {highest}")]
    Fenced {
        /// The persistence id.
        persistence_id: PersistenceId,
        /// The epoch of the refused append.
        epoch: WriterEpoch,
        /// The highest epoch recorded for the id.
        highest: WriterEpoch,
    },
    /// The sequence number is not above the id's last one (or is 0).
    #[error("persistence id {persistence_id}: sequence number {sequence_nr} is not above {last}")]
    SequenceNotIncreasing {
        /// The persistence id.
        persistence_id: PersistenceId,
        /// The refused sequence number.
        sequence_nr: SequenceNr,
        /// The id's last sequence number (0 when none).
        last: SequenceNr,
    },
    /// The record does not fit in an empty segment.
    #[error("record of {len_bytes} bytes does not fit a segment (at most {max_bytes})")]
    TooLarge {
        /// The encoded record's length, in bytes.
        len_bytes: u64,
        /// The largest record a segment holds, in bytes.
        max_bytes: u64,
    },
    /// A new segment could not be allocated (`ENOSPC` or another error
    /// from preallocation). Nothing was written; the journal is not
    /// poisoned and a later append tries again.
    #[error("allocating a new segment failed: {source}")]
    SegmentAllocation {
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Writing the record failed; the journal is now poisoned.
    #[error("writing the record failed: {source}")]
    Io {
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Errors from replaying records.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// A record on the replay path is damaged.
    #[error("segment {segment} ({file}) is corrupt at byte offset {offset}: {kind}")]
    Corrupt {
        /// The segment id.
        segment: Lsn,
        /// The segment's file name.
        file: String,
        /// Byte offset of the damaged record.
        offset: u64,
        /// What is wrong.
        kind: CorruptionKind,
    },
    /// Opening a segment failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Errors from saving or loading snapshots.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotError {
    /// The epoch is below the highest recorded for the persistence id.
    #[error("persistence id {persistence_id}: writer epoch {epoch} is fenced by epoch {highest}")]
    Fenced {
        /// The persistence id.
        persistence_id: PersistenceId,
        /// The refused epoch.
        epoch: WriterEpoch,
        /// The highest epoch recorded for the id.
        highest: WriterEpoch,
    },
    /// The snapshot's sequence number is below the saved one's, or above
    /// the id's last event.
    #[error("persistence id {persistence_id}: snapshot at {sequence_nr} refused ({reason})")]
    BadSequenceNr {
        /// The persistence id.
        persistence_id: PersistenceId,
        /// The refused sequence number.
        sequence_nr: SequenceNr,
        /// Why.
        reason: &'static str,
    },
    /// The journal is poisoned.
    #[error("journal is poisoned: {reason}")]
    Poisoned {
        /// The failed operation and its OS error.
        reason: String,
    },
    /// A snapshot file is damaged.
    #[error("snapshot file {file} is damaged: {reason}")]
    Corrupt {
        /// The file name.
        file: String,
        /// What is wrong.
        reason: FileDecodeError,
    },
    /// Reading or writing the file failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Errors from closing a journal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CloseError {
    /// The journal was (or became, during the final flush) poisoned: the
    /// records after the last durable LSN may be lost.
    #[error("journal is poisoned: {reason}")]
    Poisoned {
        /// The failed operation and its OS error.
        reason: String,
    },
}
