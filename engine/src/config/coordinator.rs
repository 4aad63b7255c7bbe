//! The `[coordinator]` table: the ShardCoordinator's rebalance and hand-off
//! timing (Akka's `akka.cluster.sharding` keys of the same meaning).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Rebalance and hand-off settings of every entity type's coordinator
/// (`[coordinator]` table; every key optional).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    /// Time between rebalance rounds, in milliseconds (Akka's
    /// `rebalance-interval`). Default 10000; 100..=3600000.
    pub rebalance_interval_ms: u64,
    /// How long one shard's hand-off may take before it is abandoned (the
    /// shard stays with its owner under a new generation), in milliseconds
    /// (Akka's `handoff-timeout`). Default 60000; 100..=3600000.
    pub handoff_timeout_ms: u64,
    /// Most shards moved per rebalance round (count; Akka's
    /// `least-shard-allocation-strategy.rebalance-absolute-limit`).
    /// Default 20; at least 1.
    pub rebalance_absolute_limit: usize,
    /// Most shards moved per round as a share of all allocated shards
    /// (Akka's `rebalance-relative-limit`); the smaller of the two limits
    /// applies. Default 0.1; in (0, 1].
    pub rebalance_relative_limit: f64,
    /// How long a recovered coordinator waits for the regions of its
    /// recovered state to register again, in milliseconds (a `GetShardHome`
    /// for one of their shards waits meanwhile). Default 10000;
    /// 100..=3600000.
    pub reregister_timeout_ms: u64,
    /// The coordinator allocates no shard until this many members are Up
    /// (count; Akka's `akka.cluster.min-nr-of-members`, which its
    /// coordinator waits for): a cluster started all at once does not put
    /// every shard on the first member and move them away again.
    /// Default 1; at least 1.
    pub min_nr_of_members: usize,
    /// Warm routing: once its regions have settled, the coordinator
    /// allocates every shard without a home in one batch (one group of
    /// journal events, one durability round) and tells every region all
    /// the homes; a node reports ready only once its regions know every
    /// shard's home (bounded by [`Self::ready_warm_timeout_ms`]). When
    /// false, shards are allocated on their first message only. Default
    /// true.
    pub warm_allocation: bool,
    /// With [`Self::warm_allocation`]: how long a node that is Up with its
    /// regions registered waits for them to know every shard's home before
    /// it reports ready anyway (logging which cores lack homes), in
    /// milliseconds. Default 10000; 0..=3600000 (0: do not wait).
    pub ready_warm_timeout_ms: u64,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            rebalance_interval_ms: 10_000,
            handoff_timeout_ms: 60_000,
            rebalance_absolute_limit: 20,
            rebalance_relative_limit: 0.1,
            reregister_timeout_ms: 10_000,
            min_nr_of_members: 1,
            warm_allocation: true,
            ready_warm_timeout_ms: 10_000,
        }
    }
}

impl CoordinatorConfig {
    /// [`Self::rebalance_interval_ms`] as a Duration.
    pub fn rebalance_interval(&self) -> Duration {
        Duration::from_millis(self.rebalance_interval_ms)
    }
    /// [`Self::handoff_timeout_ms`] as a Duration.
    pub fn handoff_timeout(&self) -> Duration {
        Duration::from_millis(self.handoff_timeout_ms)
    }
    /// [`Self::reregister_timeout_ms`] as a Duration.
    pub fn reregister_timeout(&self) -> Duration {
        Duration::from_millis(self.reregister_timeout_ms)
    }

    /// [`Self::ready_warm_timeout_ms`] as a Duration.
    pub fn ready_warm_timeout(&self) -> Duration {
        Duration::from_millis(self.ready_warm_timeout_ms)
    }

    /// Checks value ranges; `bad(key, reason)` builds the error.
    pub(super) fn validate(
        &self,
        bad: impl Fn(&str, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        for (key, v) in [
            (
                "coordinator.rebalance_interval_ms",
                self.rebalance_interval_ms,
            ),
            ("coordinator.handoff_timeout_ms", self.handoff_timeout_ms),
            (
                "coordinator.reregister_timeout_ms",
                self.reregister_timeout_ms,
            ),
        ] {
            if !(100..=3_600_000).contains(&v) {
                return Err(bad(key, format!("{v} is not in 100..=3600000")));
            }
        }
        if self.min_nr_of_members == 0 {
            return Err(bad(
                "coordinator.min_nr_of_members",
                "must be at least 1".into(),
            ));
        }
        if self.ready_warm_timeout_ms > 3_600_000 {
            return Err(bad(
                "coordinator.ready_warm_timeout_ms",
                format!("{} is not in 0..=3600000", self.ready_warm_timeout_ms),
            ));
        }
        if self.rebalance_absolute_limit == 0 {
            return Err(bad(
                "coordinator.rebalance_absolute_limit",
                "must be at least 1".into(),
            ));
        }
        let r = self.rebalance_relative_limit;
        if !(r > 0.0 && r <= 1.0) {
            return Err(bad(
                "coordinator.rebalance_relative_limit",
                format!("{r} is not in (0, 1]"),
            ));
        }
        Ok(())
    }
}
