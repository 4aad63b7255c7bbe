//! Message extractors: from a user message to (entity id, shard id, message).
//!
//! Follows Akka's `ShardingMessageExtractor` / `HashCodeMessageExtractor`,
//! except that the hash is specified (xxh3-64, seed 0, over the id's UTF-8
//! bytes) so that every process, language and release agrees on shard ids.
//! `testdata/shard-ids.txt` holds test vectors.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::ids::{EntityId, ShardId};

/// The name of the shard-id hash, recorded by the coordinator so that a node
/// that disagrees can be refused.
pub const SHARD_ID_HASH_NAME: &str = "xxh3-64-seed0-mod";

/// The shard of an entity id: `xxh3_64(seed = 0, utf8 bytes of id) %
/// number_of_shards`.
///
/// # Panics
/// If `number_of_shards` is 0.
pub fn shard_id_of(entity_id: &str, number_of_shards: u32) -> ShardId {
    assert!(number_of_shards > 0, "number_of_shards must be at least 1");
    let h = xxh3_64_with_seed(entity_id.as_bytes(), 0);
    ShardId((h % u64::from(number_of_shards)) as u32)
}

/// User code that knows how to read a message (Akka's
/// `ShardingMessageExtractor`).
pub trait MessageExtractor<E> {
    /// The message type handed to the entity.
    type Message;
    /// The entity the message is for.
    fn entity_id(&self, envelope: &E) -> EntityId;
    /// The shard of that entity.
    fn shard_id(&self, entity_id: &EntityId) -> ShardId;
    /// The message the entity receives (unwrapped from the envelope).
    fn entity_message(&self, envelope: E) -> Self::Message;
    /// The shard that a `StartEntity(entity_id)` request goes to (the same as
    /// for any message to that entity unless overridden).
    fn start_entity_shard(&self, entity_id: &EntityId) -> ShardId {
        self.shard_id(entity_id)
    }
}

/// A message wrapped with its entity id (Akka's `ShardingEnvelope`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardingEnvelope<M> {
    /// The target entity.
    pub entity_id: EntityId,
    /// The message.
    pub message: M,
}

/// The default extractor: shard = [`shard_id_of`] of the entity id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HashCodeExtractor {
    number_of_shards: u32,
}

impl HashCodeExtractor {
    /// An extractor for `number_of_shards` shards (fixed for the life of a
    /// cluster).
    ///
    /// # Panics
    /// If `number_of_shards` is 0.
    pub fn new(number_of_shards: u32) -> Self {
        assert!(number_of_shards > 0, "number_of_shards must be at least 1");
        Self { number_of_shards }
    }

    /// The number of shards.
    pub fn number_of_shards(&self) -> u32 {
        self.number_of_shards
    }
}

impl<M> MessageExtractor<ShardingEnvelope<M>> for HashCodeExtractor {
    type Message = M;
    fn entity_id(&self, envelope: &ShardingEnvelope<M>) -> EntityId {
        envelope.entity_id.clone()
    }
    fn shard_id(&self, entity_id: &EntityId) -> ShardId {
        shard_id_of(entity_id.as_str(), self.number_of_shards)
    }
    fn entity_message(&self, envelope: ShardingEnvelope<M>) -> M {
        envelope.message
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_ids_are_in_range_and_stable() {
        for n in [1u32, 7, 100, 1000] {
            for i in 0..200 {
                let id = format!("entity-{i}");
                let s = shard_id_of(&id, n);
                assert!(s.0 < n);
                assert_eq!(s, shard_id_of(&id, n));
            }
        }
        let x = HashCodeExtractor::new(100);
        let env = ShardingEnvelope {
            entity_id: EntityId::new("abc").unwrap(),
            message: 5u8,
        };
        let id = MessageExtractor::<ShardingEnvelope<u8>>::entity_id(&x, &env);
        assert_eq!(
            MessageExtractor::<ShardingEnvelope<u8>>::shard_id(&x, &id),
            shard_id_of("abc", 100)
        );
        assert_eq!(x.entity_message(env), 5);
    }
}
