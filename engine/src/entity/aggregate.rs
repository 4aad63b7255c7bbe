//! The `aggregate` built-in: a pre-aggregating stateless worker
//! (reduce-style aggregation, as the Orleans docs suggest stateless workers
//! for).
//!
//! `add <key> <n>` adds `n` (i64) to this activation's partial sum of `key`
//! and answers `ok` at once; every interval (timer, armed by the first add
//! after a flush) the activation sends each partial sum as `add <sum>` to
//! entity `<key>` of the aggregator type (a sharded `counter`), which keeps
//! the total. `get <key>` is forwarded to that entity as `get`: its answer
//! (the total so far, not counting partial sums still held by workers) goes
//! to the client.
//!
//! Guarantees of a partial sum (no more): an `ok` means the add is held in
//! one worker's memory. It reaches the aggregator with the next flush,
//! sent at most once through the normal routing path (the runtime also
//! fires the flush when it collects an idle activation and when the node
//! starts a graceful leave, when only aggregators whose shard has a home
//! get it; a leaving node then answers worker requests `ShuttingDown`);
//! it is lost if the node crashes or is downed
//! before the flush, or if the message is dropped on
//! the way (aggregator's home unreachable, buffer full). Once the
//! aggregator applied it, the total is as durable as the aggregator type
//! (the built-in `counter` journals it under the node's durability policy).
//! A partial sum is never applied twice (the engine never redelivers).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use shardline_core::ids::EntityId;

use super::{Entity, EntityContext, EntityError};

/// The aggregator type when the config does not name one.
pub const DEFAULT_TARGET_TYPE: &str = crate::config::DEFAULT_AGGREGATE_TARGET_TYPE;
/// The flush interval when the config does not say.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);
/// Distinct keys an activation holds before it flushes early (count),
/// which bounds its memory.
pub const MAX_PENDING_KEYS: usize = 10_000;
/// The timer key of the flush.
const FLUSH_TIMER: u64 = 1;

/// One activation of the `aggregate` worker: partial sums by key.
#[derive(Debug)]
pub struct Aggregate {
    to: Arc<str>,
    interval: Duration,
    sums: BTreeMap<EntityId, i64>,
    armed: bool,
}

impl Aggregate {
    /// An activation forwarding to aggregator type `to` every `interval`.
    pub fn new(to: Arc<str>, interval: Duration) -> Self {
        Aggregate {
            to,
            interval,
            sums: BTreeMap::new(),
            armed: false,
        }
    }

    /// The partial sums not flushed yet (key, sum).
    pub fn pending(&self) -> impl Iterator<Item = (&EntityId, i64)> + '_ {
        self.sums.iter().map(|(k, v)| (k, *v))
    }

    fn flush(&mut self, ctx: &mut EntityContext<'_>) {
        for (key, sum) in std::mem::take(&mut self.sums) {
            if sum != 0 {
                ctx.tell(&self.to, &key, format!("add {sum}"));
            }
        }
        if self.armed {
            ctx.cancel_timer(FLUSH_TIMER);
            self.armed = false;
        }
    }
}

fn parse_key(k: &str) -> Result<EntityId, String> {
    EntityId::new(k).map_err(|e| format!("error: bad key: {e}"))
}

impl Entity for Aggregate {
    fn handle(&mut self, ctx: &mut EntityContext<'_>, message: &[u8]) -> Result<(), EntityError> {
        let Ok(cmd) = std::str::from_utf8(message) else {
            ctx.reply("error: command is not UTF-8");
            return Ok(());
        };
        let mut words = cmd.split_ascii_whitespace();
        match (words.next(), words.next(), words.next(), words.next()) {
            (Some("add"), Some(k), Some(n), None) => {
                let key = match parse_key(k) {
                    Ok(k) => k,
                    Err(e) => {
                        ctx.reply(e);
                        return Ok(());
                    }
                };
                let n = match n.parse::<i64>() {
                    Ok(n) => n,
                    Err(e) => {
                        ctx.reply(format!("error: bad number: {e}"));
                        return Ok(());
                    }
                };
                if !self.sums.contains_key(&key) && self.sums.len() >= MAX_PENDING_KEYS {
                    self.flush(ctx);
                }
                let sum = self.sums.entry(key.clone()).or_insert(0);
                match sum.checked_add(n) {
                    Some(v) => *sum = v,
                    None => {
                        // Send what is held, then start over with `n`.
                        let held = std::mem::replace(sum, n);
                        ctx.tell(&self.to, &key, format!("add {held}"));
                    }
                }
                if !self.armed {
                    ctx.set_timer(FLUSH_TIMER, self.interval);
                    self.armed = true;
                }
                ctx.reply("ok");
            }
            (Some("get"), Some(k), None, None) => match parse_key(k) {
                Ok(key) => ctx.forward(&self.to, &key, "get"),
                Err(e) => ctx.reply(e),
            },
            _ => ctx.reply(format!(
                "error: unknown command `{}` (add <key> <n> | get <key>)",
                cmd.escape_debug()
            )),
        }
        Ok(())
    }

    fn on_timer(&mut self, ctx: &mut EntityContext<'_>, key: u64) {
        if key == FLUSH_TIMER {
            self.armed = false;
            self.flush(ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn send(a: &mut Aggregate, msg: &str) -> (String, Vec<super::super::Outgoing>) {
        let id = EntityId::new("w").unwrap();
        let mut services = crate::entity::EntityServices::default();
        let mut ctx = EntityContext::new(&id, &mut services).with_reply_token(1);
        a.handle(&mut ctx, msg.as_bytes()).unwrap();
        let reply = ctx
            .take_reply()
            .map(|r| String::from_utf8(r).unwrap())
            .unwrap_or_default();
        (reply, ctx.take_outgoing())
    }

    #[test]
    fn sums_locally_and_flushes_on_the_timer() {
        let mut a = Aggregate::new("totals".into(), Duration::from_millis(50));
        let id = EntityId::new("w").unwrap();
        let mut services = crate::entity::EntityServices::default();
        let mut ctx = EntityContext::new(&id, &mut services).with_reply_token(1);
        a.handle(&mut ctx, b"add k1 5").unwrap();
        // The first add arms the flush timer.
        assert_eq!(
            ctx.take_timers(),
            vec![(FLUSH_TIMER, Some(Duration::from_millis(50)))]
        );
        assert_eq!(send(&mut a, "add k1 -2").0, "ok");
        assert_eq!(send(&mut a, "add k2 7").1, vec![]);
        let mut ctx = EntityContext::new(&id, &mut services);
        a.on_timer(&mut ctx, FLUSH_TIMER);
        let out = ctx.take_outgoing();
        let sent: Vec<(String, String, bool)> = out
            .iter()
            .map(|o| {
                (
                    o.entity_id.as_str().to_string(),
                    String::from_utf8(o.payload.clone()).unwrap(),
                    o.forward,
                )
            })
            .collect();
        assert_eq!(
            sent,
            vec![
                ("k1".into(), "add 3".into(), false),
                ("k2".into(), "add 7".into(), false)
            ]
        );
        assert!(out.iter().all(|o| o.type_name == "totals"));
        assert_eq!(a.pending().count(), 0);
    }

    #[test]
    fn get_is_forwarded_and_bad_commands_answered() {
        let mut a = Aggregate::new("totals".into(), Duration::from_millis(50));
        let (reply, out) = send(&mut a, "get k1");
        assert_eq!(reply, "");
        assert_eq!(out.len(), 1);
        assert!(out[0].forward && out[0].payload == b"get");
        for bad in ["add k1", "add k1 x", "mul k1 2", "add  1", "get"] {
            let (r, out) = send(&mut a, bad);
            assert!(r.starts_with("error: "), "{bad}: {r}");
            assert!(out.is_empty());
        }
    }

    #[test]
    fn overflow_sends_what_is_held() {
        let mut a = Aggregate::new("totals".into(), Duration::from_millis(50));
        send(&mut a, &format!("add k {}", i64::MAX));
        let (r, out) = send(&mut a, "add k 1");
        assert_eq!(r, "ok");
        assert_eq!(out[0].payload, format!("add {}", i64::MAX).into_bytes());
        assert_eq!(a.pending().collect::<Vec<_>>()[0].1, 1);
    }
}
