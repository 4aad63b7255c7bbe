//! Identity newtypes of the journal: persistence ids, sequence numbers,
//! writer epochs and log sequence numbers.

use std::fmt;

use thiserror::Error;

/// Maximum length of a [`PersistenceId`], in bytes.
pub const MAX_PERSISTENCE_ID_LEN_BYTES: usize = 1024;

/// Errors from building a [`PersistenceId`] from untrusted input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum PersistenceIdError {
    /// The id was empty; persistence ids are 1 to 1024 bytes of UTF-8.
    #[error("persistence id is empty; it must be 1 to 1024 bytes of UTF-8")]
    Empty,
    /// The id was longer than [`MAX_PERSISTENCE_ID_LEN_BYTES`].
    #[error("persistence id is {len_bytes} bytes; at most 1024 bytes are allowed")]
    TooLong {
        /// The length that was given, in bytes.
        len_bytes: usize,
    },
    /// The id was not valid UTF-8.
    #[error("persistence id is not valid UTF-8")]
    NotUtf8,
}

/// The name of one event stream in the journal (Akka's `persistenceId`):
/// 1 to 1024 bytes of UTF-8. The journal gives it no further meaning.
///
/// One pointer wide; clones share one immutable string (reference
/// counted): the journal's per-id maps and a writer's copy hold one
/// allocation between them (the string inline in it up to 24 bytes), and
/// a clone does not allocate. Hashes, compares and orders as its `str`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PersistenceId(std::sync::Arc<compact_str::CompactString>);

impl PersistenceId {
    /// Builds a persistence id from a string.
    ///
    /// # Errors
    /// [`PersistenceIdError::Empty`] for an empty string and
    /// [`PersistenceIdError::TooLong`] above 1024 bytes.
    pub fn new(id: &str) -> Result<Self, PersistenceIdError> {
        if id.is_empty() {
            return Err(PersistenceIdError::Empty);
        }
        if id.len() > MAX_PERSISTENCE_ID_LEN_BYTES {
            return Err(PersistenceIdError::TooLong {
                len_bytes: id.len(),
            });
        }
        Ok(Self(std::sync::Arc::new(id.into())))
    }

    /// Builds a persistence id from the concatenation of `parts`, with one
    /// heap allocation (the id's own): no intermediate `String`.
    ///
    /// # Errors
    /// As [`PersistenceId::new`] for the concatenation.
    pub fn concat(parts: &[&str]) -> Result<Self, PersistenceIdError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len == 0 {
            return Err(PersistenceIdError::Empty);
        }
        if len > MAX_PERSISTENCE_ID_LEN_BYTES {
            return Err(PersistenceIdError::TooLong { len_bytes: len });
        }
        let mut buf = [0u8; MAX_PERSISTENCE_ID_LEN_BYTES];
        let mut at = 0;
        for p in parts {
            buf[at..at + p.len()].copy_from_slice(p.as_bytes());
            at += p.len();
        }
        // Concatenated `str`s are UTF-8.
        let s = std::str::from_utf8(&buf[..len]).map_err(|_| PersistenceIdError::NotUtf8)?;
        Ok(Self(std::sync::Arc::new(s.into())))
    }

    /// Builds a persistence id from bytes read from disk.
    ///
    /// # Errors
    /// As [`PersistenceId::new`], plus [`PersistenceIdError::NotUtf8`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, PersistenceIdError> {
        let s = std::str::from_utf8(bytes).map_err(|_| PersistenceIdError::NotUtf8)?;
        Self::new(s)
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id's UTF-8 bytes, as stored on disk.
    pub fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl std::borrow::Borrow<str> for PersistenceId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for PersistenceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Position of an event in its persistence id's stream (Akka's
/// `sequenceNr`): strictly increasing per persistence id, starting at 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SequenceNr(pub u64);

impl fmt::Display for SequenceNr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A writer's epoch. Per persistence id, an append carrying an epoch lower
/// than the highest recorded for that id is fenced (rejected). Per journal
/// directory, a writer may only open it with an epoch at least the highest
/// epoch of its segment headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct WriterEpoch(pub u64);

impl fmt::Display for WriterEpoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Log sequence number: the position of a record in one journal directory,
/// counting every record (events and deletion markers) from 1, without gaps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_persistence_id_is_one_pointer_and_clones_share_it() {
        assert_eq!(std::mem::size_of::<PersistenceId>(), 8);
        assert_eq!(std::mem::size_of::<Option<PersistenceId>>(), 8);
        let a = PersistenceId::new("counter|a").unwrap();
        let b = a.clone();
        assert!(std::ptr::eq(a.as_str(), b.as_str()));
        let mut m = std::collections::HashMap::new();
        m.insert(a, 1);
        assert_eq!(m.get("counter|a"), Some(&1));
    }

    #[test]
    fn persistence_id_bounds() {
        assert_eq!(PersistenceId::new(""), Err(PersistenceIdError::Empty));
        assert!(PersistenceId::new(&"x".repeat(1024)).is_ok());
        assert_eq!(
            PersistenceId::new(&"x".repeat(1025)),
            Err(PersistenceIdError::TooLong { len_bytes: 1025 })
        );
        assert_eq!(
            PersistenceId::concat(&["counter", "|", "a"])
                .unwrap()
                .as_str(),
            "counter|a"
        );
        assert_eq!(
            PersistenceId::concat(&["", ""]),
            Err(PersistenceIdError::Empty)
        );
        assert!(PersistenceId::concat(&[&"x".repeat(1000), &"y".repeat(24)]).is_ok());
        assert_eq!(
            PersistenceId::concat(&[&"x".repeat(1000), &"y".repeat(25)]),
            Err(PersistenceIdError::TooLong { len_bytes: 1025 })
        );
        assert_eq!(
            PersistenceId::from_bytes(&[0xff]),
            Err(PersistenceIdError::NotUtf8)
        );
    }
}
