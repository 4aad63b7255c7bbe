//! Remember entities in the core's journal (Akka's `remember-entities`
//! with the event-sourced store).
//!
//! The region emits `ShardEvent::EntityStarted`/`EntityStopped` as
//! effects; each is appended to the core's journal under the persistence
//! id `__shard|{type_name}|{shard}` with the shard's allocation generation
//! as writer epoch. Payload: one byte (1 started, 2 stopped) then the
//! entity id's UTF-8 bytes. When a shard starts on a core (after a move or
//! a restart), its events are read ([`recover_start`]: from every journal
//! of the data root at once, or from the database on a reader thread,
//! [`recover_poll`]) and folded into the set of entities to start, which
//! the region starts at the configured pace; the shard's messages wait in
//! the region meanwhile. A read that fails starts nothing (the core
//! retries it). The appends
//! are not waited for: a remembered start lost in a crash only means the
//! entity starts on its next message.

use std::collections::BTreeSet;
use std::time::Duration;

use shardline_core::ids::{EntityId, ShardId};
use shardline_core::sharding::{RememberEntitiesPace, ShardEvent, ShardRegion};
use shardline_journal::{PersistenceId, SequenceNr, WriterEpoch};

use super::{CoreJournal, LogError, RecoverStart, Recovered};

const STARTED: u8 = 1;
const STOPPED: u8 = 2;

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

fn generation<M, S, H: Default>(region: &ShardRegion<M, S, H>, shard: ShardId) -> u64 {
    region
        .hosted_shards()
        .find(|(s, _, _)| *s == shard)
        .map_or(0, |(_, g, _)| g.0)
}

/// Appends one remember-entities event of type `type_name` to `journal`
/// (the sequence numbers of the shard's persistence id are the journal's,
/// [`CoreJournal`]).
pub fn record<M, S, H: Default>(
    journal: &mut CoreJournal,
    type_name: &str,
    region: &ShardRegion<M, S, H>,
    ev: &ShardEvent,
) {
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
    // The shard's next sequence number, kept only once the append took
    // it: an append that failed (a segment that could not be allocated)
    // leaves no gap in the shard's numbers.
    let seq = journal.remember_seq.get(pid.as_str()).copied().unwrap_or(0) + 1;
    let res = journal
        .log()
        .and_then(|l| l.append(&pid, SequenceNr(seq), epoch, &payload));
    match res {
        Ok(_) => match journal.remember_seq.get_mut(pid.as_str()) {
            Some(last) => *last = seq,
            None => {
                journal.remember_seq.insert(pid.as_str().to_string(), seq);
            }
        },
        Err(e) => {
            tracing::warn!(pid = pid.as_str(), error = %e, "remember-entities event not stored")
        }
    }
}

/// How [`recover_start`] answered.
#[derive(Debug)]
pub enum RememberRead {
    /// Read at once (the local journal: a scan of memory-mapped segments):
    /// the live entity ids, or why they could not be read.
    Ready(Result<Vec<EntityId>, LogError>),
    /// Read on a reader thread of the PostgreSQL backend: poll
    /// [`recover_poll`] with this ticket after the core's durability wake
    /// fired.
    Pending(u64),
}

/// Starts reading the remembered entities of `shard` (type `type_name`),
/// with the shard's allocation generation as writer epoch. The local
/// journal reads at once (its segments are memory-mapped; this is the
/// path it always had), the PostgreSQL backend on a reader thread, so the
/// core never waits for the database.
///
/// # Errors
/// In [`RememberRead::Ready`]: [`LogError`] when the records cannot be
/// read (no journal on this core, database unavailable, unreadable
/// journal). The shard must not start then (it would start empty).
pub fn recover_start<M, S, H: Default>(
    journal: &mut CoreJournal,
    type_name: &str,
    region: &ShardRegion<M, S, H>,
    shard: ShardId,
) -> RememberRead {
    let Some(pid) = pid(type_name, shard) else {
        return RememberRead::Ready(Ok(Vec::new()));
    };
    let epoch = WriterEpoch(generation(region, shard));
    match journal.log().map(|l| l.recover_start(&pid, epoch, 0)) {
        Err(e) => RememberRead::Ready(Err(LogError::failed(e))),
        Ok(RecoverStart::Ready(r)) => RememberRead::Ready(r.map(|r| fold(journal, &pid, &r))),
        Ok(RecoverStart::Pending(ticket)) => RememberRead::Pending(ticket),
    }
}

/// The result of the read `ticket` of `shard`'s remembered entities
/// (taking it), `None` while it is in flight.
///
/// # Errors
/// `Some(Err(_))` as [`recover_start`]'s.
pub fn recover_poll(
    journal: &mut CoreJournal,
    type_name: &str,
    shard: ShardId,
    ticket: u64,
) -> Option<Result<Vec<EntityId>, LogError>> {
    let pid = pid(type_name, shard)?;
    match journal.log().map(|l| l.recover_poll(&pid, ticket)) {
        Err(e) => Some(Err(LogError::failed(e))),
        Ok(None) => None,
        Ok(Some(r)) => Some(r.map(|r| fold(journal, &pid, &r))),
    }
}

/// Drops the read `ticket` (its shard stopped or moved meanwhile).
pub fn recover_forget(journal: &mut CoreJournal, ticket: u64) {
    if let Ok(l) = journal.log() {
        l.recover_forget(ticket);
    }
}

/// Folds a shard's remember-entities records into its live set and
/// continues the shard's sequence numbers on this core after them.
fn fold(journal: &mut CoreJournal, pid: &PersistenceId, rec: &Recovered) -> Vec<EntityId> {
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
    // Continue the sequence in this core's journal after the recovered one
    // (and after a claim row's number).
    let last = last.max(rec.highest);
    let own_last = journal.log().map_or(0, |l| l.highest_sequence_nr(pid));
    journal
        .remember_seq
        .insert(pid.as_str().to_string(), last.max(own_last));
    live.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistence::EventLog;
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

    /// The local journal reads at once.
    fn read(
        j: &mut CoreJournal,
        t: &str,
        r: &ShardRegion<Vec<u8>, ()>,
        shard: ShardId,
    ) -> Vec<EntityId> {
        match recover_start(j, t, r, shard) {
            RememberRead::Ready(res) => res.expect("read"),
            RememberRead::Pending(_) => panic!("the local journal reads at once"),
        }
    }

    fn started(shard: u32, id: &str) -> ShardEvent {
        ShardEvent::EntityStarted {
            shard: ShardId(shard),
            entity: EntityId::new(id).expect("id"),
        }
    }

    /// A log that refuses appends while `refuse` is set (as a journal
    /// that cannot allocate its next segment does) and keeps the
    /// sequence numbers of those it took.
    struct Refusing {
        inner: Box<dyn EventLog>,
        refuse: std::rc::Rc<std::cell::Cell<bool>>,
        taken: std::rc::Rc<std::cell::RefCell<Vec<u64>>>,
    }

    impl EventLog for Refusing {
        fn append(
            &mut self,
            pid: &PersistenceId,
            seq: SequenceNr,
            epoch: WriterEpoch,
            payload: &[u8],
        ) -> Result<shardline_journal::Lsn, String> {
            if self.refuse.get() {
                return Err("no segment could be allocated".into());
            }
            self.taken.borrow_mut().push(seq.0);
            self.inner.append(pid, seq, epoch, payload)
        }
        fn recover(
            &mut self,
            pid: &PersistenceId,
            epoch: WriterEpoch,
        ) -> Result<crate::persistence::Recovered, String> {
            self.inner.recover(pid, epoch)
        }
        fn save_snapshot(
            &mut self,
            pid: &PersistenceId,
            seq: SequenceNr,
            epoch: WriterEpoch,
            data: &[u8],
        ) -> Result<(), String> {
            self.inner.save_snapshot(pid, seq, epoch, data)
        }
        fn durable_lsn(&self) -> shardline_journal::Lsn {
            self.inner.durable_lsn()
        }
        fn highest_sequence_nr(&self, pid: &PersistenceId) -> u64 {
            self.inner.highest_sequence_nr(pid)
        }
        fn wait_durable(&mut self, lsn: shardline_journal::Lsn) -> Result<(), String> {
            self.inner.wait_durable(lsn)
        }
    }

    #[test]
    fn a_refused_remember_event_leaves_no_gap_in_the_shards_numbers() {
        let dir = tempfile::tempdir().expect("tmp");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let mut opened = CoreJournal::open_local(dir.path(), 0, &none, None).expect("open");
        let refuse = std::rc::Rc::new(std::cell::Cell::new(false));
        let taken = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let mut j = CoreJournal::with_log_installed(Box::new(Refusing {
            inner: opened.take().expect("a journal"),
            refuse: refuse.clone(),
            taken: taken.clone(),
        }));
        let r = region();
        record(&mut j, "t", &r, &started(3, "a"));
        refuse.set(true);
        record(&mut j, "t", &r, &started(3, "b"));
        refuse.set(false);
        record(&mut j, "t", &r, &started(3, "c"));
        record(&mut j, "t", &r, &started(4, "z"));
        // Shard 3's numbers run 1, 2 (the refused event took none); shard
        // 4 has its own.
        assert_eq!(*taken.borrow(), vec![1, 2, 1]);
        let ids: Vec<String> = read(&mut j, "t", &r, ShardId(3))
            .into_iter()
            .map(|i| i.as_str().to_string())
            .collect();
        assert_eq!(ids, vec!["a", "c"]);
    }

    #[test]
    fn remembered_entities_survive_reopening_and_are_read_from_another_core() {
        let dir = tempfile::tempdir().expect("tmp");
        let none = crate::config::Durability::Named(crate::config::DurabilityName::None);
        let node = dir.path().join("node-a");
        let mut j = CoreJournal::open_local(&node, 0, &none, None).expect("open");
        let r = region();
        assert!(read(&mut j, "t", &r, ShardId(3)).is_empty());
        record(&mut j, "t", &r, &started(3, "a"));
        record(&mut j, "t", &r, &started(3, "b"));
        record(&mut j, "t", &r, &started(4, "z"));
        record(
            &mut j,
            "t",
            &r,
            &ShardEvent::EntityStopped {
                shard: ShardId(3),
                entity: EntityId::new("a").expect("id"),
            },
        );
        record(&mut j, "t", &r, &started(3, "c"));
        drop(j);
        // Core 1 of the same node: core 0's journal is read-only to it.
        let mut j = CoreJournal::open_local(&node, 1, &none, None).expect("open");
        let ids: Vec<String> = read(&mut j, "t", &r, ShardId(3))
            .into_iter()
            .map(|i| i.as_str().to_string())
            .collect();
        assert_eq!(ids, vec!["b", "c"]);
        // Appends continue the sequence after the other journal's events.
        record(&mut j, "t", &r, &started(3, "d"));
        let ids = read(&mut j, "t", &r, ShardId(3));
        assert_eq!(ids.len(), 3);
        drop(j.take());
        // Without a journal the read fails: the shard must not start empty.
        match recover_start(&mut j, "t", &r, ShardId(3)) {
            RememberRead::Ready(Err(e)) => assert!(e.message.contains("no journal"), "{e}"),
            other => panic!("expected a failed read, got {other:?}"),
        }
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
