//! Remember entities in the core's journal (Akka's `remember-entities`
//! with the event-sourced store).
//!
//! The region emits `ShardEvent::EntityStarted`/`EntityStopped` as
//! effects; each is appended to the core's journal under the persistence
//! id `__shard|{type_name}|{shard}` with the shard's allocation generation
//! as writer epoch. Payload: one byte (1 started, 2 stopped) then the
//! entity id's UTF-8 bytes. When a shard starts on a core (after a move or
//! a restart), its events are read from every journal of the data root
//! (see [`super::EventLog::recover`]) and folded into the set of entities
//! to start, which the region starts at the configured pace. The appends
//! are not waited for: a remembered start lost in a crash only means the
//! entity starts on its next message.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use shardline_core::ids::{EntityId, ShardId};
use shardline_core::sharding::{RememberEntitiesPace, ShardEvent, ShardRegion};
use shardline_journal::{PersistenceId, SequenceNr, WriterEpoch};

use super::with_log;

const STARTED: u8 = 1;
const STOPPED: u8 = 2;

thread_local! {
    /// Last sequence number per shard persistence id on this core.
    static SEQ: RefCell<HashMap<String, u64>> = RefCell::new(HashMap::new());
}

/// The pace of `remember_entities_per_s` (0 = all at once): batches every
/// 100 ms.
pub fn pace(per_s: u32) -> RememberEntitiesPace {
    if per_s == 0 {
        RememberEntitiesPace::AllAtOnce
    } else {
        RememberEntitiesPace::Constant {
            per_interval: (per_s as usize).div_ceil(10).max(1),
            interval: Duration::from_millis(100),
        }
    }
}

fn pid(type_name: &str, shard: ShardId) -> Option<PersistenceId> {
    PersistenceId::new(&format!("__shard|{type_name}|{}", shard.0)).ok()
}

fn generation<M, S>(region: &ShardRegion<M, S>, shard: ShardId) -> u64 {
    region
        .hosted_shards()
        .find(|(s, _, _)| *s == shard)
        .map_or(0, |(_, g, _)| g.0)
}

/// Appends one remember-entities event of type `type_name`.
pub fn record<M, S>(type_name: &str, region: &ShardRegion<M, S>, ev: &ShardEvent) {
    let (kind, shard, entity) = match ev {
        ShardEvent::EntityStarted { shard, entity } => (STARTED, *shard, entity),
        ShardEvent::EntityStopped { shard, entity } => (STOPPED, *shard, entity),
    };
    let Some(pid) = pid(type_name, shard) else {
        return;
    };
    let epoch = WriterEpoch(generation(region, shard));
    let mut payload = Vec::with_capacity(1 + entity.as_str().len());
    payload.push(kind);
    payload.extend_from_slice(entity.as_str().as_bytes());
    let seq = SEQ.with(|s| {
        let mut s = s.borrow_mut();
        let e = s.entry(pid.as_str().to_string()).or_insert(0);
        *e += 1;
        *e
    });
    if let Err(e) = with_log(|l| l.append(&pid, SequenceNr(seq), epoch, &payload)).and_then(|r| r) {
        tracing::warn!(pid = pid.as_str(), error = %e, "remember-entities event not stored");
    }
}

/// The remembered entities of `shard`, read from the data root's journals.
pub fn recover<M, S>(type_name: &str, region: &ShardRegion<M, S>, shard: ShardId) -> Vec<EntityId> {
    let Some(pid) = pid(type_name, shard) else {
        return Vec::new();
    };
    let epoch = WriterEpoch(generation(region, shard));
    let rec = match with_log(|l| l.recover(&pid, epoch)).and_then(|r| r) {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(pid = pid.as_str(), error = %e, "remembered entities not read");
            return Vec::new();
        }
    };
    let mut live = BTreeSet::new();
    let mut last = rec.snapshot.as_ref().map_or(0, |s| s.0);
    for (seq, p) in &rec.events {
        last = *seq;
        let Some((&kind, id)) = p.split_first() else {
            continue;
        };
        let Ok(id) = EntityId::from_bytes(id) else {
            continue;
        };
        match kind {
            STARTED => {
                live.insert(id);
            }
            STOPPED => {
                live.remove(&id);
            }
            _ => {}
        }
    }
    // Continue the sequence in this core's journal after the recovered one.
    let own_last = with_log(|l| l.highest_sequence_nr(&pid)).unwrap_or(0);
    SEQ.with(|s| {
        s.borrow_mut()
            .insert(pid.as_str().to_string(), last.max(own_last))
    });
    live.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_core::ids::{Address, MemberUid, RegionId, UniqueAddress};
    use shardline_core::sharding::RegionSettings;

    fn region() -> ShardRegion<Vec<u8>, ()> {
        let id = RegionId {
            member: UniqueAddress {
                address: Address("127.0.0.1:1".into()),
                uid: MemberUid(1),
            },
            core: 0,
        };
        ShardRegion::new_proxy(id, RegionSettings::default(), Duration::ZERO)
    }

    fn started(shard: u32, id: &str) -> ShardEvent {
        ShardEvent::EntityStarted {
            shard: ShardId(shard),
            entity: EntityId::new(id).expect("id"),
        }
    }

    #[test]
    fn remembered_entities_survive_reopening_and_are_read_from_another_core() {
        let dir = tempfile::tempdir().expect("tmp");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let node = dir.path().join("node-a");
        super::super::open_for_core(&node, 0, &none, None).expect("open");
        let r = region();
        assert!(recover("t", &r, ShardId(3)).is_empty());
        record("t", &r, &started(3, "a"));
        record("t", &r, &started(3, "b"));
        record("t", &r, &started(4, "z"));
        record(
            "t",
            &r,
            &ShardEvent::EntityStopped {
                shard: ShardId(3),
                entity: EntityId::new("a").expect("id"),
            },
        );
        record("t", &r, &started(3, "c"));
        drop(super::super::uninstall());
        SEQ.with(|s| s.borrow_mut().clear());
        // Core 1 of the same node: core 0's journal is read-only to it.
        super::super::open_for_core(&node, 1, &none, None).expect("open");
        let ids: Vec<String> = recover("t", &r, ShardId(3))
            .into_iter()
            .map(|i| i.as_str().to_string())
            .collect();
        assert_eq!(ids, vec!["b", "c"]);
        // Appends continue the sequence after the other journal's events.
        record("t", &r, &started(3, "d"));
        let ids = recover("t", &r, ShardId(3));
        assert_eq!(ids.len(), 3);
        drop(super::super::uninstall());
        assert_eq!(pace(0), RememberEntitiesPace::AllAtOnce);
        assert_eq!(
            pace(25),
            RememberEntitiesPace::Constant {
                per_interval: 3,
                interval: Duration::from_millis(100)
            }
        );
    }
}
