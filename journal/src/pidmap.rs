//! The journal's maps keyed by persistence id: one hasher for all of them
//! and a table split into fixed partitions, so that no doubling moves more
//! than a small part of the ids at once and no old half stays allocated.

use std::hash::BuildHasher;
use std::sync::{LazyLock, OnceLock};

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

use crate::ids::PersistenceId;

/// The hasher of every [`PidMap`] of the process: foldhash with one seed
/// drawn at random when the first map is made (ids come from clients, so
/// the seed must not be guessable: HashDoS), the same in every map, so
/// that an append hashes its id once for the catalog and the active
/// segment's index ([`pid_hash`]).
#[derive(Clone, Debug)]
pub(crate) struct PidHash(foldhash::fast::SeedableRandomState);

impl Default for PidHash {
    fn default() -> Self {
        static SEED: OnceLock<u64> = OnceLock::new();
        let seed = *SEED.get_or_init(|| foldhash::fast::RandomState::default().hash_one(0u64));
        PidHash(foldhash::fast::SeedableRandomState::with_seed(
            seed,
            foldhash::SharedSeed::global_random(),
        ))
    }
}

impl BuildHasher for PidHash {
    type Hasher = foldhash::fast::FoldHasher<'static>;

    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }
}

/// The process's [`PidHash`], built once.
static PID_HASH: LazyLock<PidHash> = LazyLock::new(PidHash::default);

/// The hash of `pid` in every [`PidMap`] (they share [`PidHash`]'s seed).
/// A [`PersistenceId`] hashes as its `str`.
pub(crate) fn pid_hash(pid: &str) -> u64 {
    PID_HASH.hash_one(pid)
}

/// Partitions of a [`PidMap`]: each is a table of its own that doubles
/// alone, so a doubling copies about 1/256 of the ids (a million ids:
/// about 4,000 entries, tens of µs) instead of all of them at once, which
/// paused the appending data core for tens of ms at a million ids.
const PARTITIONS: usize = 256;

/// Ids above which a map splits its one table into [`PARTITIONS`] (a
/// small map, such as a short segment's index, stays one table: 256 empty
/// tables would cost 8 KiB).
const SPLIT_AT: usize = 4096;

/// The partition of `hash` among `n` (1 or [`PARTITIONS`]): bits 32-39,
/// which the partition's own table uses neither for its bucket index (the
/// low bits, below 2^32 buckets) nor for its control bytes (the top 7
/// bits).
fn partition(hash: u64, n: usize) -> usize {
    ((hash >> 32) as usize) & (n - 1)
}

/// A map from persistence id to `V`, hashed with [`PidHash`]: one hash
/// table up to [`SPLIT_AT`] ids, then 256 chosen by bits of the id's hash.
/// An entry costs the 8-byte id pointer plus `V` (and one control byte),
/// at the table's load (44-87.5 %); no table keeps an old half after it
/// doubled (the incremental resizing used before kept it, 30-60 bytes per
/// id at a million ids, until enough later inserts had moved its entries).
///
/// Lookups compare ids as strings (a writer's id is the journal's own
/// shared copy, so the comparison stops at the pointer).
pub(crate) struct PidMap<V> {
    parts: Box<[HashTable<(PersistenceId, V)>]>,
    len: usize,
}

impl<V> Default for PidMap<V> {
    fn default() -> Self {
        PidMap {
            parts: Box::new([]),
            len: 0,
        }
    }
}

impl<V: Clone> Clone for PidMap<V> {
    fn clone(&self) -> Self {
        PidMap {
            parts: self.parts.clone(),
            len: self.len,
        }
    }
}

impl<V: std::fmt::Debug> std::fmt::Debug for PidMap<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

fn rehash<V>(e: &(PersistenceId, V)) -> u64 {
    pid_hash(e.0.as_str())
}

impl<V> PidMap<V> {
    /// Number of ids.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The table `hash` falls in, if there is one.
    fn part(&self, hash: u64) -> Option<&HashTable<(PersistenceId, V)>> {
        match self.parts.len() {
            0 => None,
            n => self.parts.get(partition(hash, n)),
        }
    }

    /// The table `hash` falls in, made (or split) first when due.
    fn part_mut(&mut self, hash: u64) -> &mut HashTable<(PersistenceId, V)> {
        if self.parts.is_empty() {
            self.parts = Box::new([HashTable::new()]);
        } else if self.parts.len() == 1 && self.len >= SPLIT_AT {
            self.split();
        }
        let n = self.parts.len();
        &mut self.parts[partition(hash, n)]
    }

    /// Moves the entries of the one table into [`PARTITIONS`] tables
    /// (once, at [`SPLIT_AT`] ids: about 4,000 moves).
    fn split(&mut self) {
        let mut parts: Box<[HashTable<(PersistenceId, V)>]> =
            (0..PARTITIONS).map(|_| HashTable::new()).collect();
        let one = std::mem::take(&mut self.parts[0]);
        for e in one {
            let hash = rehash(&e);
            parts[partition(hash, PARTITIONS)].insert_unique(hash, e, rehash);
        }
        self.parts = parts;
    }

    /// The entry of `pid` (`hash`: its [`pid_hash`]).
    pub(crate) fn get_hashed(&self, hash: u64, pid: &str) -> Option<&(PersistenceId, V)> {
        self.part(hash)?.find(hash, |(k, _)| k.as_str() == pid)
    }

    /// The value of `pid` (`hash`: its [`pid_hash`]); the map's copy of
    /// a writer's id compares by pointer.
    pub(crate) fn get_pid(&self, hash: u64, pid: &PersistenceId) -> Option<&V> {
        self.part(hash)?
            .find(hash, |(k, _)| k == pid)
            .map(|(_, v)| v)
    }

    /// The value of `pid`.
    pub(crate) fn get(&self, pid: &str) -> Option<&V> {
        self.get_hashed(pid_hash(pid), pid).map(|(_, v)| v)
    }

    /// The map's own copy of `pid` and its value.
    pub(crate) fn get_key_value(&self, pid: &str) -> Option<(&PersistenceId, &V)> {
        self.get_hashed(pid_hash(pid), pid).map(|(k, v)| (k, v))
    }

    /// Whether `pid` has an entry.
    pub(crate) fn contains_key(&self, pid: &str) -> bool {
        self.get(pid).is_some()
    }

    /// The value of `pid` (`hash`: its [`pid_hash`]), inserted with `make`
    /// (under a clone of `pid`) when absent.
    pub(crate) fn get_or_insert_with(
        &mut self,
        hash: u64,
        pid: &PersistenceId,
        make: impl FnOnce() -> V,
    ) -> &mut V {
        self.part_mut(hash);
        let n = self.parts.len();
        let (parts, len) = (&mut self.parts, &mut self.len);
        match parts[partition(hash, n)].entry(hash, |(k, _)| k == pid, rehash) {
            Entry::Occupied(o) => &mut o.into_mut().1,
            Entry::Vacant(v) => {
                *len += 1;
                &mut v.insert((pid.clone(), make())).into_mut().1
            }
        }
    }

    /// Sets `pid`'s value, returning the one it replaced.
    pub(crate) fn insert(&mut self, pid: PersistenceId, value: V) -> Option<V> {
        let hash = pid_hash(pid.as_str());
        let part = self.part_mut(hash);
        match part.entry(hash, |(k, _)| *k == pid, rehash) {
            Entry::Occupied(mut o) => Some(std::mem::replace(&mut o.get_mut().1, value)),
            Entry::Vacant(v) => {
                v.insert((pid, value));
                self.len += 1;
                None
            }
        }
    }

    /// Every id and its value, in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&PersistenceId, &V)> + '_ {
        self.parts
            .iter()
            .flat_map(|t| t.iter().map(|(k, v)| (k, v)))
    }

    /// Every id, in no particular order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &PersistenceId> + '_ {
        self.iter().map(|(k, _)| k)
    }

    /// The value of `pid` (`hash`: its [`pid_hash`]), to change.
    pub(crate) fn get_mut_pid(&mut self, hash: u64, pid: &PersistenceId) -> Option<&mut V> {
        let n = self.parts.len();
        if n == 0 {
            return None;
        }
        self.parts[partition(hash, n)]
            .find_mut(hash, |(k, _)| k == pid)
            .map(|(_, v)| v)
    }

    /// Every id and its value, taken out, in no particular order.
    pub(crate) fn into_entries(self) -> impl Iterator<Item = (PersistenceId, V)> {
        self.parts.into_vec().into_iter().flatten()
    }
}

impl<V: Default> PidMap<V> {
    /// The value of `pid`, inserted as `V::default()` when absent.
    pub(crate) fn entry_or_default(&mut self, pid: &PersistenceId) -> &mut V {
        self.get_or_insert_with(pid_hash(pid.as_str()), pid, V::default)
    }

    /// The value of `pid` given as a string, inserted as `V::default()`
    /// under a new id (or `shared`'s copy, when it has one) when absent;
    /// `None` when `pid` is not a valid persistence id.
    pub(crate) fn entry_or_default_str<W>(
        &mut self,
        pid: &str,
        shared: &PidMap<W>,
    ) -> Option<&mut V> {
        let hash = pid_hash(pid);
        if self.get_hashed(hash, pid).is_none() {
            let p = match shared.get_hashed(hash, pid) {
                Some((k, _)) => k.clone(),
                None => PersistenceId::new(pid).ok()?,
            };
            self.get_or_insert_with(hash, &p, V::default);
        }
        let n = self.parts.len();
        self.parts[partition(hash, n)]
            .find_mut(hash, |(k, _)| k.as_str() == pid)
            .map(|(_, v)| v)
    }
}

impl<V> FromIterator<(PersistenceId, V)> for PidMap<V> {
    fn from_iter<I: IntoIterator<Item = (PersistenceId, V)>>(iter: I) -> Self {
        let mut m = PidMap::default();
        for (k, v) in iter {
            m.insert(k, v);
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pid(s: &str) -> PersistenceId {
        PersistenceId::new(s).expect("valid id")
    }

    #[test]
    fn inserts_finds_replaces_and_counts_across_partitions() {
        let mut m: PidMap<u64> = PidMap::default();
        assert_eq!(m.get("a"), None);
        for i in 0..10_000u64 {
            assert_eq!(m.insert(pid(&format!("p{i}")), i), None);
            if i == 100 {
                assert_eq!(m.parts.len(), 1, "a small map is one table");
            }
        }
        for i in 0..10_000u64 {
            assert_eq!(
                m.get(&format!("p{i}")),
                Some(&i),
                "p{i} found after the split"
            );
        }
        assert_eq!(m.len(), 10_000);
        assert_eq!(m.insert(pid("p7"), 70), Some(7));
        assert_eq!(m.len(), 10_000);
        *m.entry_or_default(&pid("p8")) += 1;
        let p = pid("p9");
        *m.get_or_insert_with(pid_hash(p.as_str()), &p, || 0) += 1;
        *m.entry_or_default(&pid("new")) += 5;
        assert_eq!(m.len(), 10_001);
        assert_eq!(m.get("p7"), Some(&70));
        assert_eq!(m.get("p8"), Some(&9));
        assert_eq!(m.get("p9"), Some(&10));
        assert_eq!(m.get("new"), Some(&5));
        assert!(m.contains_key("p9999") && !m.contains_key("p10000"));
        assert_eq!(
            m.get_key_value("p1").map(|(k, v)| (k.as_str(), *v)),
            Some(("p1", 1))
        );
        assert_eq!(m.iter().count(), 10_001);
        assert_eq!(m.parts.len(), PARTITIONS);
        let used = m.parts.iter().filter(|t| !t.is_empty()).count();
        assert!(used > PARTITIONS / 2, "ids spread over {used} partitions");
        let c = m.clone();
        assert_eq!(c.len(), m.len());
        assert_eq!(c.get("p7"), Some(&70));
        let back: PidMap<u64> = m.iter().map(|(k, v)| (k.clone(), *v)).collect();
        assert_eq!(back.len(), 10_001);
    }
}
