//! # shardline-journal
//!
//! An append-only, segmented, memory-mapped event journal: records with a
//! persistence id, a sequence number and a writer epoch; group commit under
//! a durability policy; replay through per-segment indexes; snapshots;
//! deletion; fencing; recovery that cuts torn tails and refuses corruption.
//! It knows nothing of entities or sharding: it stores records.
//!
//! ```text
//!  dir/
//!    00000000000000000001.seg   sealed segment (records LSN 1..)
//!    00000000000000000001.idx   its index: per persistence id, seq -> offset
//!    00000000000000004711.seg   open segment, preallocated, mmap'd
//!    spare-...tmp               next segment, being preallocated
//!    snapshots.tbl              latest snapshot of every id whose snapshot is small
//!                               (a pair of 256-byte slots per id)
//!    1a2b3c4d-0.snap            latest snapshot of one id too large for a slot
//!    journal.state              checkpoint, written when segments are removed
//! ```
//!
//! Threading model: one [`Journal`] per directory, owned by one thread (one
//! per data core); it appends with `memcpy` into the mapped segment and
//! never flushes. A sync thread per journal runs every flush that an
//! acknowledgement waits for (crossbeam channel), a meta thread makes index,
//! checkpoint and snapshot files and the snapshot table durable in order
//! (behind the sync thread),
//! a helper thread preallocates the next segment, and
//! [`DurabilityWatcher`] tells any thread when an LSN is durable (poll,
//! block, or callback). [`JournalReader`] opens another writer's directory
//! read-only.
//!
//! Invariants (checked in code where they are established):
//! - LSNs are contiguous from 1 within a directory; a segment is named by
//!   the LSN of its first record.
//! - Per persistence id, sequence numbers strictly increase (checked on
//!   append) and writer epochs never decrease (appends below the highest
//!   are [`AppendError::Fenced`]).
//! - A record is acknowledged durable only after `fdatasync` of its segment
//!   (and of every earlier segment, whose index file is then written).
//! - After any write or flush error, the journal is poisoned: every later
//!   append fails and nothing more is acknowledged.
//! - No byte pattern on disk makes recovery panic or allocate from an
//!   unchecked length.
//!
//! The byte layout and the recovery decision table are in `FORMAT.md`.

pub mod error;
pub mod format;
pub mod ids;
mod journal;
mod pidmap;
mod recovery;
pub mod storage;
mod sync;
mod table;
pub mod verify;

pub use error::{
    AppendError, CloseError, CorruptionKind, OpenError, RecoveryError, ReplayError, SnapshotError,
};
pub use format::{RecordKind, RecordView, Snapshot};
pub use ids::{Lsn, PersistenceId, PersistenceIdError, SequenceNr, WriterEpoch};
pub use journal::{
    Durability, FlushLatency, Journal, JournalOptions, JournalReader, Record, Recovery,
    RecoveryMode,
};
pub use recovery::{RecoveryReport, Repair, TornTail};
pub use sync::{DurabilityError, DurabilityWatcher, DurableCallback};
