//! The `[cluster]` table: what a node does when the cluster will not have
//! it.

use serde::{Deserialize, Serialize};

/// What a node does when a seed node refuses it at the handshake (another
/// protocol version, `number_of_shards` or cluster name): it never forms a
/// cluster of its own either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnJoinRefused {
    /// Log the refusal and keep asking the seeds (a seed restarted with a
    /// matching configuration lets it in). The default.
    #[default]
    Retry,
    /// Stop: `shardline node` exits with the refusal as its error and exit
    /// code 1, so that a supervisor sees the misconfiguration (Akka's
    /// `configuration-compatibility-check.enforce-on-join`, which shuts a
    /// refused joining node down).
    Exit,
}

/// The `[cluster]` table (every key optional).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterTableConfig {
    /// `"retry"` (default) or `"exit"`: see [`OnJoinRefused`].
    pub on_join_refused: OnJoinRefused,
    /// Consecutive refused connections to a member's cluster port (count;
    /// ECONNREFUSED or a reset while connecting, never a timeout), with no
    /// message from it in between, after which its process is taken as gone:
    /// the split-brain resolver downs it at once when its strategy keeps
    /// this side, and the leader removes it at convergence (its shards move
    /// then), without `downing_stable_after_ms` or the down-removal margin.
    /// Default 3; 0 turns it off (timeouts and the resolver only). See
    /// `docs/node.md`, membership, for what a refusal proves and what not.
    pub refusals_to_down: u32,
    /// Interval of the probes (heartbeats) to a member whose connection was
    /// lost or refused, in milliseconds: the refusals are counted at most
    /// one per half interval. Default 200; 10..=10000.
    pub refusal_probe_interval_ms: u64,
}

impl Default for ClusterTableConfig {
    fn default() -> Self {
        Self {
            on_join_refused: OnJoinRefused::default(),
            refusals_to_down: 3,
            refusal_probe_interval_ms: 200,
        }
    }
}

impl ClusterTableConfig {
    /// Checks value ranges.
    ///
    /// # Errors
    /// The error `bad` builds for the first bad key
    /// (`cluster.refusals_to_down` above 100,
    /// `cluster.refusal_probe_interval_ms` outside 10..=10000).
    pub fn validate<E>(&self, bad: impl Fn(&str, String) -> E) -> Result<(), E> {
        if self.refusals_to_down > 100 {
            return Err(bad(
                "cluster.refusals_to_down",
                format!("{} is not in 0..=100", self.refusals_to_down),
            ));
        }
        if !(10..=10_000).contains(&self.refusal_probe_interval_ms) {
            return Err(bad(
                "cluster.refusal_probe_interval_ms",
                format!("{} is not in 10..=10000", self.refusal_probe_interval_ms),
            ));
        }
        Ok(())
    }
}
