//! Automatic passivation: idle timeout and an active-entity limit with a
//! pluggable replacement policy (Akka's "Automatic Passivation" strategies;
//! least-recently-used is the default).

use crate::det::DetState;
use std::time::Duration;

use super::EntityKey;

/// Passivation settings of a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PassivationSettings {
    /// Passivate an entity that got no message for this long; `None`
    /// disables it. Default 120 s. Checked every `idle_timeout / 2`, as Akka
    /// does, so an idle entity stops between 1x and 1.5x the timeout.
    pub idle_timeout: Option<Duration>,
    /// Most active entities in the region (count); when a new entity would
    /// exceed it, the replacement policy picks one to passivate. `None`
    /// (default) means unlimited.
    pub active_entity_limit: Option<usize>,
}

impl Default for PassivationSettings {
    fn default() -> Self {
        Self {
            idle_timeout: Some(Duration::from_secs(120)),
            active_entity_limit: None,
        }
    }
}

/// Picks which active entity to passivate when the active-entity limit is
/// reached. The region tells it about every activation, access and removal.
pub trait ReplacementPolicy {
    /// An entity became active (it was not tracked).
    fn on_activate(&mut self, key: &EntityKey);
    /// A message was delivered to an active entity.
    fn on_access(&mut self, key: &EntityKey);
    /// The entity is no longer active (passivating or stopped).
    fn on_remove(&mut self, key: &EntityKey);
    /// The entity to passivate next, if any (it stays tracked until
    /// [`on_remove`](Self::on_remove)).
    fn select_victim(&mut self) -> Option<EntityKey>;
}

const NIL: usize = usize::MAX;

#[derive(Debug)]
struct Node {
    key: EntityKey,
    prev: usize,
    next: usize,
}

/// Nodes per chunk of [`Arena`] (a chunk of `Node`s is 56 KiB).
const CHUNK: usize = 1024;

/// A growable array in fixed chunks of [`CHUNK`] elements: growing it
/// allocates one more chunk and never moves or copies the elements
/// already in it (a `Vec` that doubles copies all of them at once, a
/// pause on the core that grows it).
#[derive(Debug)]
struct Arena<T> {
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Arena<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn push(&mut self, value: T) {
        if self.len.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        self.chunks[self.len / CHUNK].push(value);
        self.len += 1;
    }
}

impl<T> std::ops::Index<usize> for Arena<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        &self.chunks[i / CHUNK][i % CHUNK]
    }
}

impl<T> std::ops::IndexMut<usize> for Arena<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i / CHUNK][i % CHUNK]
    }
}

/// Least-recently-used: the entity whose last message is oldest goes first.
/// O(1) per operation (a hash map into an arena-backed doubly linked list).
/// The map resizes incrementally (`griddle`: when it doubles, entries move
/// to the new table a few per insert) and the arena grows by chunks, so no
/// single activation pays for moving every tracked entity.
#[derive(Debug, Default)]
pub struct LruPolicy {
    nodes: Arena<Node>,
    free: Vec<usize>,
    index: griddle::HashMap<EntityKey, usize, DetState>,
    /// Most recently used.
    head: Option<usize>,
    /// Least recently used.
    tail: Option<usize>,
}

impl LruPolicy {
    /// An empty policy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of tracked entities.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no entity is tracked.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn unlink(&mut self, i: usize) {
        let (p, n) = (self.nodes[i].prev, self.nodes[i].next);
        if p == NIL {
            self.head = (n != NIL).then_some(n);
        } else {
            self.nodes[p].next = n;
        }
        if n == NIL {
            self.tail = (p != NIL).then_some(p);
        } else {
            self.nodes[n].prev = p;
        }
    }

    fn push_front(&mut self, i: usize) {
        self.nodes[i].prev = NIL;
        self.nodes[i].next = self.head.unwrap_or(NIL);
        if let Some(h) = self.head {
            self.nodes[h].prev = i;
        }
        self.head = Some(i);
        if self.tail.is_none() {
            self.tail = Some(i);
        }
    }
}

impl ReplacementPolicy for LruPolicy {
    fn on_activate(&mut self, key: &EntityKey) {
        if self.index.contains_key(key) {
            self.on_access(key);
            return;
        }
        let node = Node {
            key: key.clone(),
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.index.insert(key.clone(), i);
        self.push_front(i);
    }

    fn on_access(&mut self, key: &EntityKey) {
        if let Some(&i) = self.index.get(key) {
            if self.head != Some(i) {
                self.unlink(i);
                self.push_front(i);
            }
        }
    }

    fn on_remove(&mut self, key: &EntityKey) {
        if let Some(i) = self.index.remove(key) {
            self.unlink(i);
            self.free.push(i);
        }
    }

    fn select_victim(&mut self) -> Option<EntityKey> {
        self.tail.map(|t| self.nodes[t].key.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{EntityId, ShardId};

    fn k(s: &str) -> EntityKey {
        (ShardId(0), EntityId::new(s).unwrap())
    }

    #[test]
    fn lru_order() {
        let mut p = LruPolicy::new();
        assert_eq!(p.select_victim(), None);
        p.on_activate(&k("a"));
        p.on_activate(&k("b"));
        p.on_activate(&k("c"));
        assert_eq!(p.select_victim(), Some(k("a")));
        p.on_access(&k("a"));
        assert_eq!(p.select_victim(), Some(k("b")));
        p.on_remove(&k("b"));
        assert_eq!(p.select_victim(), Some(k("c")));
        p.on_remove(&k("c"));
        p.on_remove(&k("a"));
        assert!(p.is_empty());
        assert_eq!(p.select_victim(), None);
        p.on_activate(&k("d"));
        assert_eq!(p.select_victim(), Some(k("d")));
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn arena_keeps_its_elements_in_place_across_chunks() {
        let mut a: Arena<u64> = Arena::default();
        for i in 0..(3 * CHUNK as u64 + 7) {
            a.push(i * 10);
        }
        assert_eq!(a.len(), 3 * CHUNK + 7);
        assert_eq!(a.chunks.len(), 4);
        let first = &a[0] as *const u64;
        a.push(1);
        assert_eq!(first, &a[0] as *const u64, "growing moved an element");
        for i in [0, CHUNK - 1, CHUNK, 2 * CHUNK + 5, 3 * CHUNK + 6] {
            assert_eq!(a[i], i as u64 * 10);
        }
        a[CHUNK] = 99;
        assert_eq!(a[CHUNK], 99);
    }

    #[test]
    fn lru_order_holds_across_arena_chunks_and_reused_slots() {
        let mut p = LruPolicy::new();
        let n = 3 * CHUNK + 10;
        for i in 0..n {
            p.on_activate(&k(&format!("e{i}")));
        }
        // Touch every even entity: the odd ones are now the oldest.
        for i in (0..n).step_by(2) {
            p.on_access(&k(&format!("e{i}")));
        }
        for i in (1..n).step_by(2) {
            assert_eq!(p.select_victim(), Some(k(&format!("e{i}"))));
            p.on_remove(&k(&format!("e{i}")));
        }
        // Freed slots are reused by new entities, which are the newest.
        p.on_activate(&k("new"));
        assert_eq!(p.len(), n / 2 + 1);
        assert_eq!(p.nodes.len(), n, "a freed slot was not reused");
        assert_eq!(p.select_victim(), Some(k("e0")));
    }
}
