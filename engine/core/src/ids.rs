//! Identity newtypes shared by the sharding and cluster state machines.
//!
//! Time is never read here: every state machine takes `now: Duration`, the
//! time elapsed since an origin chosen by the runtime (the node's start, or
//! zero in the simulation).

use std::fmt;

use compact_str::CompactString;
use thiserror::Error;

/// Errors from building an identity from untrusted input.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum IdError {
    /// The id was empty; ids are 1 to 255 bytes.
    #[error("{kind} is empty; it must be 1 to 255 bytes of UTF-8")]
    Empty {
        /// Which kind of id ("entity id", "type name").
        kind: &'static str,
    },
    /// The id was longer than 255 bytes.
    #[error("{kind} is {len_bytes} bytes; at most 255 bytes are allowed")]
    TooLong {
        /// Which kind of id.
        kind: &'static str,
        /// The length that was given, in bytes.
        len_bytes: usize,
    },
    /// The id was not valid UTF-8.
    #[error("{kind} is not valid UTF-8")]
    NotUtf8 {
        /// Which kind of id.
        kind: &'static str,
    },
    /// A type name held `|`, began with `__` or was `coordinator`: the
    /// journal names an entity's events `{type}|{id}` and the engine's own
    /// records `__shard|…` (remember entities) and `coordinator|{type}`,
    /// so such a name could share a persistence id with another type's
    /// entity or the engine's records.
    #[error("{kind} {reason}")]
    Reserved {
        /// Which kind of id.
        kind: &'static str,
        /// What in it is reserved.
        reason: &'static str,
    },
}

/// Maximum length of an [`EntityId`] or [`TypeName`], in bytes.
pub const MAX_ID_LEN_BYTES: usize = 255;

fn check(kind: &'static str, s: &str) -> Result<(), IdError> {
    if s.is_empty() {
        return Err(IdError::Empty { kind });
    }
    if s.len() > MAX_ID_LEN_BYTES {
        return Err(IdError::TooLong {
            kind,
            len_bytes: s.len(),
        });
    }
    Ok(())
}

/// [`check`], plus what a type name may not hold ([`IdError::Reserved`]).
fn check_type_name(kind: &'static str, s: &str) -> Result<(), IdError> {
    check(kind, s)?;
    if s.contains('|') {
        return Err(IdError::Reserved {
            kind,
            reason: "contains '|', which separates the type from the entity id in a persistence id",
        });
    }
    if s.starts_with("__") {
        return Err(IdError::Reserved {
            kind,
            reason: "starts with '__', which is reserved for the engine's own persistence ids",
        });
    }
    if s == "coordinator" {
        return Err(IdError::Reserved {
            kind,
            reason:
                "is `coordinator`: the coordinators' persistence ids are `coordinator|{type}`, \
                     which such a type's entities would share (in a shared journal)",
        });
    }
    Ok(())
}

// Ids are stored as `CompactString`s: up to 24 bytes inline (no heap
// allocation, 24 bytes like a `String`), longer ones on the heap. An entity
// id is kept by its region and its core, and built for every request.
macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $check:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(CompactString);

        impl $name {
            /// Builds the id from a string.
            ///
            /// # Errors
            /// [`IdError::Empty`] for an empty string, [`IdError::TooLong`]
            /// above 255 bytes; for a type name, [`IdError::Reserved`].
            pub fn new(s: impl AsRef<str>) -> Result<Self, IdError> {
                let s = s.as_ref();
                $check($kind, s)?;
                Ok(Self(CompactString::new(s)))
            }

            /// Builds the id from untrusted bytes.
            ///
            /// # Errors
            /// [`IdError::NotUtf8`] when the bytes are not UTF-8, and the
            /// errors of [`Self::new`].
            pub fn from_bytes(b: &[u8]) -> Result<Self, IdError> {
                if b.len() > MAX_ID_LEN_BYTES {
                    return Err(IdError::TooLong { kind: $kind, len_bytes: b.len() });
                }
                let s = std::str::from_utf8(b).map_err(|_| IdError::NotUtf8 { kind: $kind })?;
                $check($kind, s)?;
                Ok(Self(CompactString::new(s)))
            }

            /// The id as a string slice.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(
    /// The name of an entity type (`type_name`), 1 to 255 bytes of UTF-8,
    /// without `|`, not starting with `__` and not `coordinator`
    /// ([`IdError::Reserved`]): an entity's persistence id is
    /// `{type}|{id}`, which names one entity only when the type holds no
    /// `|`, and `__shard|…` and `coordinator|…` are the engine's.
    TypeName,
    "type name",
    check_type_name
);
string_id!(
    /// The id of an entity within its type, 1 to 255 bytes of UTF-8.
    EntityId,
    "entity id",
    check
);

/// A shard number in `0..number_of_shards`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ShardId(pub u32);

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A member's network address, `host:port` (the cluster address).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Address(pub std::sync::Arc<str>);

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A random number drawn by a node at each start (one per incarnation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MemberUid(pub u64);

/// A member: its address plus the uid of this incarnation. A node restarted
/// at the same address is a different `UniqueAddress`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UniqueAddress {
    /// The member's cluster address.
    pub address: Address,
    /// The incarnation's uid.
    pub uid: MemberUid,
}

impl fmt::Display for UniqueAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.address, self.uid.0)
    }
}

/// A ShardRegion: one per data core per member.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RegionId {
    /// The member hosting the region.
    pub member: UniqueAddress,
    /// The data core index on that member (0-based).
    pub core: u16,
}

impl fmt::Display for RegionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/core-{}", self.member, self.core)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entity_id_bounds() {
        assert!(matches!(EntityId::new(""), Err(IdError::Empty { .. })));
        assert!(EntityId::new("a".repeat(255)).is_ok());
        assert!(matches!(
            EntityId::new("a".repeat(256)),
            Err(IdError::TooLong { len_bytes: 256, .. })
        ));
        assert!(matches!(
            EntityId::from_bytes(&[0xff, 0xfe]),
            Err(IdError::NotUtf8 { .. })
        ));
    }

    #[test]
    fn a_type_name_cannot_share_a_persistence_id_with_another_type() {
        // "a" + "b|c" and "a|b" + "c" would both be persistence id "a|b|c".
        assert!(EntityId::new("b|c").is_ok());
        assert!(matches!(
            TypeName::new("a|b"),
            Err(IdError::Reserved { .. })
        ));
        assert!(matches!(
            TypeName::from_bytes(b"a|b"),
            Err(IdError::Reserved { .. })
        ));
        // "__shard" + "counter|3" would read remember-entities records.
        let e = TypeName::new("__shard").unwrap_err();
        assert!(e.to_string().contains("reserved"), "{e}");
        // "coordinator" + "counter" would be the counter coordinator's id.
        assert!(matches!(
            TypeName::new("coordinator"),
            Err(IdError::Reserved { .. })
        ));
        assert!(TypeName::new("coordinators").is_ok());
        assert!(TypeName::new("_counter").is_ok());
        assert!(TypeName::new("counter").is_ok());
    }
}
