//! Lifecycle monitoring of sharded entities (Akka's DeathWatch,
//! <https://doc.akka.io/docs/akka/current/actors.html#lifecycle-monitoring-aka-deathwatch>).
//!
//! A watch is a pair of system messages routed like user messages, as
//! envelopes to an entity id through the regions (buffered, forwarded to
//! other cores and nodes, handed off), never through shared state:
//!
//! - `Watch { watcher, target }` goes to the target's home. If the target is
//!   active there, the home core records the watcher in its `watched_by`
//!   set; if not (never started, stopped, stopping), it answers
//!   `Terminated(NotActive)` at once. System messages are passive in the
//!   region ([`ShardRegion::set_passive_filter`]): they never create an
//!   entity nor refresh its idle timer.
//! - `Unwatch { watcher }` removes the watcher from the target's set.
//! - `Terminated { of, reason }` goes to the watcher when the target's
//!   incarnation stops. The watcher's core delivers it only if the watcher
//!   is active and still watches `of` (its `watching` set), so a notice
//!   reaches the incarnation that asked, once, and never after `unwatch`.
//!
//! When the watcher stops, its `watching` set is dropped and an `Unwatch`
//! goes to each target. When a member is removed, every watcher on this
//! core whose target's shard home (as this core's region knows it) was on
//! that member gets `Terminated(NodeRemoved)`.
//!
//! [`ShardRegion::set_passive_filter`]: shardline_core::sharding::ShardRegion::set_passive_filter

use std::collections::HashMap;

use shardline_core::ids::EntityId;

use crate::entity::{TerminatedReason, WatchCommand};

/// An entity anywhere in the cluster: its type and id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct EntityKey {
    /// The entity type's name.
    pub type_name: String,
    /// The entity's id.
    pub id: EntityId,
}

/// A lifecycle system message, carried as the sender of an envelope
/// (`ReplyTo::System`) to the entity named by the envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SystemMsg {
    /// To `target`: `watcher` watches you.
    Watch {
        /// The entity that watches.
        watcher: EntityKey,
        /// The entity watched.
        target: EntityKey,
    },
    /// To the target: `watcher` no longer watches you.
    Unwatch {
        /// The entity that watched.
        watcher: EntityKey,
    },
    /// To a watcher: `of` stopped.
    Terminated {
        /// The entity that stopped.
        of: EntityKey,
        /// Why it stopped.
        reason: TerminatedReason,
    },
}

/// Wire kinds of [`SystemMsg`] (`DataFrame::System::kind`).
pub(crate) const KIND_WATCH: u8 = 0;
pub(crate) const KIND_UNWATCH: u8 = 1;
pub(crate) const KIND_TERMINATED: u8 = 2;

impl SystemMsg {
    /// `(kind, peer, reason)` for the wire: the peer is the watcher of a
    /// watch or unwatch and the stopped entity of a `Terminated`.
    pub fn to_wire(&self) -> (u8, &EntityKey, u8) {
        match self {
            SystemMsg::Watch { watcher, .. } => (KIND_WATCH, watcher, 0),
            SystemMsg::Unwatch { watcher } => (KIND_UNWATCH, watcher, 0),
            SystemMsg::Terminated { of, reason } => (KIND_TERMINATED, of, reason.as_u8()),
        }
    }

    /// The message of a wire `(kind, peer, reason)` sent to `to`.
    ///
    /// # Errors
    /// A description of an unknown kind or reason.
    pub fn from_wire(kind: u8, peer: EntityKey, reason: u8, to: EntityKey) -> Result<Self, String> {
        match kind {
            KIND_WATCH => Ok(SystemMsg::Watch {
                watcher: peer,
                target: to,
            }),
            KIND_UNWATCH => Ok(SystemMsg::Unwatch { watcher: peer }),
            KIND_TERMINATED => match TerminatedReason::from_u8(reason) {
                Some(reason) => Ok(SystemMsg::Terminated { of: peer, reason }),
                None => Err(format!("unknown terminated reason {reason}")),
            },
            k => Err(format!("unknown system message kind {k}")),
        }
    }
}

/// Most entities one entity may watch at a time (count); further watches
/// are refused (logged, no notice).
pub(crate) const MAX_WATCHES_PER_ENTITY: usize = 10_000;

/// The watch state of one data core.
#[derive(Default)]
pub(crate) struct WatchBook {
    /// An active entity of this core → its watchers (anywhere).
    watched_by: HashMap<EntityKey, Vec<EntityKey>>,
    /// An active entity of this core → the entities it watches.
    watching: HashMap<EntityKey, Vec<EntityKey>>,
    /// Entities of this core that asked to stop because they failed.
    failed: std::collections::HashSet<EntityKey>,
    /// System messages to route once the current input is handled:
    /// (recipient, message).
    outgoing: Vec<(EntityKey, SystemMsg)>,
}

impl WatchBook {
    /// Applies a handler's watch commands for `me`.
    pub fn commands(&mut self, me: &EntityKey, cmds: Vec<WatchCommand>) {
        for cmd in cmds {
            let (watch, target) = match cmd {
                WatchCommand::Watch { type_name, id } => (true, EntityKey { type_name, id }),
                WatchCommand::Unwatch { type_name, id } => (false, EntityKey { type_name, id }),
            };
            if target == *me {
                continue;
            }
            if watch {
                let w = self.watching.entry(me.clone()).or_default();
                if w.contains(&target) {
                    continue;
                }
                if w.len() >= MAX_WATCHES_PER_ENTITY {
                    tracing::warn!(entity = %me.id, target = %target.id, "too many watches; watch refused");
                    continue;
                }
                w.push(target.clone());
                self.outgoing.push((
                    target.clone(),
                    SystemMsg::Watch {
                        watcher: me.clone(),
                        target,
                    },
                ));
            } else if let Some(w) = self.watching.get_mut(me) {
                if let Some(i) = w.iter().position(|t| *t == target) {
                    w.swap_remove(i);
                    if w.is_empty() {
                        self.watching.remove(me);
                    }
                    self.outgoing.push((
                        target,
                        SystemMsg::Unwatch {
                            watcher: me.clone(),
                        },
                    ));
                }
            }
        }
    }

    /// `me` asked to stop because it failed.
    pub fn mark_failed(&mut self, me: &EntityKey) {
        self.failed.insert(me.clone());
    }

    /// A `Watch` reached `target`, active (`true`) or not on this core.
    pub fn on_watch(&mut self, target: EntityKey, watcher: EntityKey, active: bool) {
        if !active {
            self.outgoing.push((
                watcher,
                SystemMsg::Terminated {
                    of: target,
                    reason: TerminatedReason::NotActive,
                },
            ));
            return;
        }
        let w = self.watched_by.entry(target).or_default();
        if !w.contains(&watcher) {
            w.push(watcher);
        }
    }

    /// An `Unwatch` reached `target`.
    pub fn on_unwatch(&mut self, target: &EntityKey, watcher: &EntityKey) {
        if let Some(w) = self.watched_by.get_mut(target) {
            w.retain(|x| x != watcher);
            if w.is_empty() {
                self.watched_by.remove(target);
            }
        }
    }

    /// A `Terminated` for `watcher` about `of`: whether to deliver it (the
    /// watch is consumed).
    pub fn take_watch(&mut self, watcher: &EntityKey, of: &EntityKey) -> bool {
        let Some(w) = self.watching.get_mut(watcher) else {
            return false;
        };
        let Some(i) = w.iter().position(|t| t == of) else {
            return false;
        };
        w.swap_remove(i);
        if w.is_empty() {
            self.watching.remove(watcher);
        }
        true
    }

    /// The incarnation of `key` on this core stopped: its watchers get
    /// `Terminated` (reason `Failed` if it asked to stop after failures),
    /// its own watches are dropped (with an `Unwatch` to each target).
    pub fn on_stopped(&mut self, key: &EntityKey, reason: TerminatedReason) {
        let reason = if self.failed.remove(key) {
            TerminatedReason::Failed
        } else {
            reason
        };
        if let Some(ws) = self.watched_by.remove(key) {
            for w in ws {
                self.outgoing.push((
                    w,
                    SystemMsg::Terminated {
                        of: key.clone(),
                        reason,
                    },
                ));
            }
        }
        if let Some(ts) = self.watching.remove(key) {
            for t in ts {
                self.outgoing.push((
                    t,
                    SystemMsg::Unwatch {
                        watcher: key.clone(),
                    },
                ));
            }
        }
    }

    /// A system message could not be delivered: a watch is answered
    /// `Terminated(Unreachable)`; anything else is dropped.
    pub fn undeliverable(&mut self, msg: SystemMsg) {
        if let SystemMsg::Watch { watcher, target } = msg {
            self.outgoing.push((
                watcher,
                SystemMsg::Terminated {
                    of: target,
                    reason: TerminatedReason::Unreachable,
                },
            ));
        }
    }

    /// Member removal: every (watcher, target) pair on this core for which
    /// `on_removed(target)` is true gets `Terminated(NodeRemoved)`.
    pub fn on_member_removed(&mut self, mut on_removed: impl FnMut(&EntityKey) -> bool) {
        for (watcher, targets) in &self.watching {
            for t in targets {
                if on_removed(t) {
                    self.outgoing.push((
                        watcher.clone(),
                        SystemMsg::Terminated {
                            of: t.clone(),
                            reason: TerminatedReason::NodeRemoved,
                        },
                    ));
                }
            }
        }
    }

    /// The system messages to route now.
    pub fn take_outgoing(&mut self) -> Vec<(EntityKey, SystemMsg)> {
        std::mem::take(&mut self.outgoing)
    }

    /// Whether there are system messages to route.
    pub fn has_outgoing(&self) -> bool {
        !self.outgoing.is_empty()
    }

    /// (watched entities with watchers, watchers with watches) on this core.
    #[cfg(test)]
    pub fn sizes(&self) -> (usize, usize) {
        (self.watched_by.len(), self.watching.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(t: &str, id: &str) -> EntityKey {
        EntityKey {
            type_name: t.into(),
            id: EntityId::new(id).unwrap(),
        }
    }

    #[test]
    fn watch_stop_terminated_once_and_state_is_dropped() {
        let (a, b) = (key("t", "a"), key("t", "b"));
        let mut book = WatchBook::default();
        book.commands(
            &a,
            vec![WatchCommand::Watch {
                type_name: "t".into(),
                id: b.id.clone(),
            }],
        );
        book.commands(
            &a,
            vec![WatchCommand::Watch {
                type_name: "t".into(),
                id: b.id.clone(),
            }],
        );
        let out = book.take_outgoing();
        assert_eq!(out.len(), 1, "watching twice is one watch");
        book.on_watch(b.clone(), a.clone(), true);
        book.on_stopped(&b, TerminatedReason::Stopped);
        let out = book.take_outgoing();
        assert_eq!(
            out,
            vec![(
                a.clone(),
                SystemMsg::Terminated {
                    of: b.clone(),
                    reason: TerminatedReason::Stopped
                }
            )]
        );
        assert!(book.take_watch(&a, &b));
        assert!(!book.take_watch(&a, &b), "delivered once");
        assert_eq!(book.sizes(), (0, 0));
    }

    #[test]
    fn unwatch_and_watcher_stop_drop_watches() {
        let (a, b) = (key("t", "a"), key("u", "b"));
        let mut book = WatchBook::default();
        book.commands(
            &a,
            vec![WatchCommand::Watch {
                type_name: "u".into(),
                id: b.id.clone(),
            }],
        );
        book.commands(
            &a,
            vec![WatchCommand::Unwatch {
                type_name: "u".into(),
                id: b.id.clone(),
            }],
        );
        let out = book.take_outgoing();
        assert!(matches!(out[1].1, SystemMsg::Unwatch { .. }), "{out:?}");
        assert!(!book.take_watch(&a, &b));
        book.commands(
            &a,
            vec![WatchCommand::Watch {
                type_name: "u".into(),
                id: b.id.clone(),
            }],
        );
        let _ = book.take_outgoing();
        book.on_stopped(&a, TerminatedReason::Stopped);
        let out = book.take_outgoing();
        assert_eq!(
            out,
            vec![(b.clone(), SystemMsg::Unwatch { watcher: a.clone() })]
        );
        assert!(!book.take_watch(&a, &b));
    }

    #[test]
    fn not_active_failed_and_wire_round_trip() {
        let (a, b) = (key("t", "a"), key("t", "b"));
        let mut book = WatchBook::default();
        book.on_watch(b.clone(), a.clone(), false);
        let out = book.take_outgoing();
        assert!(matches!(
            &out[0].1,
            SystemMsg::Terminated {
                reason: TerminatedReason::NotActive,
                ..
            }
        ));
        book.on_watch(b.clone(), a.clone(), true);
        book.mark_failed(&b);
        book.on_stopped(&b, TerminatedReason::Stopped);
        let out = book.take_outgoing();
        let msg = &out[0].1;
        assert!(matches!(
            msg,
            SystemMsg::Terminated {
                reason: TerminatedReason::Failed,
                ..
            }
        ));
        let (k, peer, r) = msg.to_wire();
        assert_eq!(
            &SystemMsg::from_wire(k, peer.clone(), r, a.clone()).unwrap(),
            msg
        );
        assert!(SystemMsg::from_wire(9, a.clone(), 0, b.clone()).is_err());
        assert!(SystemMsg::from_wire(KIND_TERMINATED, a, 99, b).is_err());
    }
}
